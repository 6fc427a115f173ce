-- Retires a node's slot and claims a new one, keeping its lease (AllBlocksCleared).
-- KEYS: node hash, slots hash, dead set, slot cursor, slot change stream, its counter     ARGV: max_slots
-- Returns the new slot, -1 when none is free, -2 when the node retired too many slots.
local node = redis.call('HMGET', KEYS[1], 'incarnation', 'lease_until', 'node_id', 'address')
local s = rotate_slot(KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[1]))
if s == false then
  return -2
end
if s == nil then
  return -1
end
set_slot(KEYS[2], s, slot_record(node[3], node[1], node[2], node[4]))
return s
