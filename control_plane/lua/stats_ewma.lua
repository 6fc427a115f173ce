-- Folds reported samples into exponentially weighted moving averages.
-- Read-modify-write in one script so two replicas folding samples at once never lose one.
-- KEYS: one stats hash     ARGV: alpha, field1, value1, field2, value2, ...
local alpha = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local sample = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  local new = sample
  if old then
    new = alpha * sample + (1 - alpha) * old
  end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', new))
end
return #ARGV / 2
