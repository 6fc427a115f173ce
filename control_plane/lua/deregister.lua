-- Removes a node; its slot goes to the sweep. The incarnation counter survives.
-- KEYS: node hash, slots hash, dead set, nodes set, slot change stream, its counter     ARGV: node_id, incarnation
local inc = redis.call('HGET', KEYS[1], 'incarnation')
if not inc or redis.call('HGET', KEYS[1], 'node_id') == false then
  return {'unknown'}
end
if inc ~= ARGV[2] then
  return {'stale', inc}
end
local old = redis.call('HGET', KEYS[1], 'slot')
if old and old ~= '' then
  redis.call('HDEL', KEYS[2], old)
  log_slot(old, '')
  redis.call('SADD', KEYS[3], old)
end
redis.call('HSET', KEYS[1], 'slot', '', 'lease_until', 0)
redis.call('SREM', KEYS[4], ARGV[1])
return {'ok'}
