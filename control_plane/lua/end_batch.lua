-- Records that a batch was applied. Idempotent.
-- KEYS: node hash     ARGV: incarnation, seq
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then
  return 0
end
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq') or '0')
if tonumber(ARGV[2]) > last then
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[2])
end
return 1
