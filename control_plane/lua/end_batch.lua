-- Records that a batch was applied, and what it changed in each node slot's entry counts (all of the slot's, and
-- the batch's tenant's). Idempotent but for the counts (a batch is ended once).
-- KEYS: node hash, slot entry counts (hash), then each changed slot's tenant entry counts (hash), in ARGV's order
-- ARGV: incarnation, seq, tenant, then slot, change, the tenant's change, slot, change, the tenant's change, ...
local j = 3
for i = 4, #ARGV, 3 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
  if ARGV[i + 2] ~= '0' then
    redis.call('HINCRBY', KEYS[j], ARGV[3], ARGV[i + 2])
  end
  j = j + 1
end
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then
  return 0
end
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq') or '0')
if tonumber(ARGV[2]) > last then
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[2])
end
return 1
