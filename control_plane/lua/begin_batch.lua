-- Decides what to do with a node's event batch, before anything is applied.
-- KEYS: node hash, slots hash, dead set, slot cursor, slot change stream, its counter
-- ARGV: incarnation, seq, reset (0/1), max_slots
-- Returns {'apply', slot} | {'duplicate'} | {'gap', expected} | {'unknown'}
--       | {'stale', current} | {'expired'} | {'noslot'}
-- A replayed batch (seq already applied) is a duplicate even when it is a
-- reset, so a late retransmission can never wipe newer state.
local node = redis.call('HMGET', KEYS[1], 'incarnation', 'slot', 'lease_until', 'last_seq', 'node_id', 'address')
if not node[1] or not node[5] then
  return {'unknown'}
end
if node[1] ~= ARGV[1] then
  return {'stale', node[1]}
end
local now = now_ms()
if not node[2] or node[2] == '' or tonumber(node[3]) < now then
  return {'expired'}
end
local seq = tonumber(ARGV[2])
local last = tonumber(node[4])
if seq <= last then
  return {'duplicate'}
end
if ARGV[3] == '1' then
  local s = rotate_slot(KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[4]))
  if s == false then
    return {'retired'}
  end
  if s == nil then
    return {'noslot'}
  end
  set_slot(KEYS[2], s, slot_record(node[5], node[1], node[3], node[6]))
  redis.call('HSET', KEYS[1], 'last_seq', seq - 1)
  return {'apply', s}
end
if seq ~= last + 1 then
  return {'gap', last + 1}
end
return {'apply', tonumber(node[2])}
