-- Shared helpers, prepended to every script that needs them.
-- A block-map value is a run of 2-byte entries, one per holding node slot:
-- entry = slot * 8 + tier_mask (GPU=1, CPU=2, DISK=4), big-endian.
redis.replicate_commands()

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Picks a slot that is neither live nor awaiting its garbage sweep.
-- KEYS: slots hash, dead set, cursor string. Returns the slot or nil.
local function claim_slot(slots_key, dead_key, cursor_key, max_slots)
  for _ = 1, max_slots do
    local s = redis.call('INCR', cursor_key) % max_slots
    if redis.call('HEXISTS', slots_key, s) == 0 and redis.call('SISMEMBER', dead_key, s) == 0 then
      return s
    end
  end
  return nil
end

-- Retires the node's current slot (its entries stop matching at once) and claims a new one.
local function rotate_slot(node_key, slots_key, dead_key, cursor_key, max_slots)
  local old = redis.call('HGET', node_key, 'slot')
  if old and old ~= '' then
    redis.call('HDEL', slots_key, old)
    redis.call('SADD', dead_key, old)
  end
  local s = claim_slot(slots_key, dead_key, cursor_key, max_slots)
  if s == nil then
    redis.call('HSET', node_key, 'slot', '')
    return nil
  end
  redis.call('HSET', node_key, 'slot', s)
  return s
end

-- The slots-hash value: what a lookup needs to know about a live slot.
local function slot_record(node_id, incarnation, lease_until, address)
  return node_id .. '\t' .. incarnation .. '\t' .. lease_until .. '\t' .. address
end
