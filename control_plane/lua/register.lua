-- Registers a node: new incarnation, new slot, fresh lease, seq restarts at 1.
-- KEYS: node hash, slots hash, dead set, slot cursor, nodes set, node names (hash), slot change stream, its counter
-- ARGV: node_id, address, pool, labels_json, lease_ms, max_slots
-- Returns {incarnation, slot}, {incarnation, -1} when no slot is free, {0, -2} when the node
-- retired too many slots since the last garbage collection, {0, -3, other} when a registered node's id differs
-- from node_id only by case (a TLS name is case-insensitive: either's certificate would answer as the other)
-- (nothing changed on either refusal).
local folded = string.lower(ARGV[1])
local other = redis.call('HGET', KEYS[6], folded)
if other and other ~= ARGV[1] and redis.call('SISMEMBER', KEYS[5], other) == 1 then
  return {0, -3, other}
end
local current = redis.call('HGET', KEYS[1], 'slot')
if current and current ~= '' and retire_limit_reached(KEYS[1]) then
  return {0, -2}
end
local now = now_ms()
local inc = redis.call('HINCRBY', KEYS[1], 'incarnation', 1)
local lease_until = now + tonumber(ARGV[5])
local s = rotate_slot(KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[6]))
redis.call('HSET', KEYS[1], 'node_id', ARGV[1], 'address', ARGV[2], 'pool', ARGV[3], 'labels', ARGV[4],
           'lease_until', lease_until, 'last_seq', 0, 'registered_ms', now)
redis.call('SADD', KEYS[5], ARGV[1])
redis.call('HSET', KEYS[6], folded, ARGV[1])
if s == nil then
  return {inc, -1}
end
set_slot(KEYS[2], s, slot_record(ARGV[1], inc, lease_until, ARGV[2]))
return {inc, s}
