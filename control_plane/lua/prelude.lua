-- Shared helpers, prepended to every script that needs them.
-- A block-map value is a run of 2-byte entries, one per holding node slot:
-- entry = slot * 8 + tier_mask (GPU=1, CPU=2, DISK=4), big-endian.
redis.replicate_commands()

-- Every change of the live-slot table is appended to the slot change stream (read replicas follow it):
-- the two last KEYS of every script that includes this prelude are that stream and its sequence counter.
local function log_slot(slot, record)
  local seq = redis.call('INCR', KEYS[#KEYS])
  redis.call('XADD', KEYS[#KEYS - 1], 'MAXLEN', '~', 10000, seq .. '-0', 's', slot, 'r', record)
end

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

-- Most slots one node may retire between two garbage collections: re-registering (or clearing)
-- in a loop must not fill the slot table with unswept slots and lock every other node out.
local MAX_RETIRED_PER_NODE = 16

local function retire_limit_reached(node_key)
  return tonumber(redis.call('HGET', node_key, 'retired') or '0') >= MAX_RETIRED_PER_NODE
end

-- Retires the node's current slot (its entries stop matching at once) and claims a new one.
-- Returns the slot, nil when none is free, false when the node retired too many (nothing changed).
local function rotate_slot(node_key, slots_key, dead_key, cursor_key, max_slots)
  local old = redis.call('HGET', node_key, 'slot')
  if old and old ~= '' then
    if retire_limit_reached(node_key) then
      return false
    end
    redis.call('HDEL', slots_key, old)
    log_slot(old, '')
    redis.call('SADD', dead_key, old)
    redis.call('HINCRBY', node_key, 'retired', 1)
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

-- Sets a live slot's record (and logs it).
local function set_slot(slots_key, slot, record)
  redis.call('HSET', slots_key, slot, record)
  log_slot(slot, record)
end
