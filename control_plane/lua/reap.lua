-- Retires the slots of nodes whose lease expired (their entries already stopped
-- matching at expiry: lookups check leases); the sweep then frees the slots.
-- KEYS: slots hash, dead set, slot change stream, its counter     ARGV: key prefix for node hashes ("...:node:")
-- Returns the number of slots retired.
local now = now_ms()
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  local rec = all[i + 1]
  local node_id, _, lease_until = string.match(rec, '^([^\t]*)\t([^\t]*)\t([^\t]*)\t')
  if tonumber(lease_until) < now then
    redis.call('HDEL', KEYS[1], all[i])
    log_slot(all[i], '')
    redis.call('SADD', KEYS[2], all[i])
    local node_key = ARGV[1] .. node_id
    if redis.call('HGET', node_key, 'slot') == all[i] then
      redis.call('HSET', node_key, 'slot', '')
    end
    n = n + 1
  end
end
return n
