-- Records that a batch was applied, and what it changed in each node slot's entry count. Idempotent but for the
-- counts (a batch is ended once).
-- KEYS: node hash, slot entry counts (hash)     ARGV: incarnation, seq, then slot, change, slot, change, ...
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then
  return 0
end
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq') or '0')
if tonumber(ARGV[2]) > last then
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[2])
end
return 1
