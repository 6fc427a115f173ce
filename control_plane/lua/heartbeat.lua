-- Renews a live node's lease.
-- KEYS: node hash, slots hash, slot change stream, its counter     ARGV: incarnation, lease_ms
-- Returns {'ok', lease_until} | {'unknown'} | {'stale', current} | {'expired'}
local node = redis.call('HMGET', KEYS[1], 'incarnation', 'slot', 'lease_until', 'node_id', 'address')
if not node[1] or not node[4] then
  return {'unknown'}
end
if node[1] ~= ARGV[1] then
  return {'stale', node[1]}
end
local now = now_ms()
if not node[2] or node[2] == '' or tonumber(node[3]) < now then
  return {'expired'}
end
local lease_until = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_until', lease_until)
set_slot(KEYS[2], node[2], slot_record(node[4], node[1], lease_until, node[5]))
return {'ok', lease_until}
