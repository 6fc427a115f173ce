-- Folds reported samples into exponentially weighted moving averages.
-- Read-modify-write in one script so two replicas folding samples at once never lose one.
-- A field the hash does not hold yet is added only while it holds fewer than max_fields (reports name their own
-- engines and links, so a reporter making names up would otherwise grow it, and every replica's HGETALL of it,
-- without bound).
-- KEYS: one stats hash     ARGV: alpha, max_fields, field1, value1, field2, value2, ...
local alpha = tonumber(ARGV[1])
local max_fields = tonumber(ARGV[2])
local size = redis.call('HLEN', KEYS[1])
local folded = 0
for i = 3, #ARGV, 2 do
  local sample = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  local new = sample
  if old then
    new = alpha * sample + (1 - alpha) * old
  end
  if old or size < max_fields then
    if not old then
      size = size + 1
    end
    redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', new))
    folded = folded + 1
  end
end
return folded
