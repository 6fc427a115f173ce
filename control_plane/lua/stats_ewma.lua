-- Folds reported samples into exponentially weighted moving averages.
-- Read-modify-write in one script so two replicas folding samples at once never lose one.
-- A field the hash does not hold yet is added only while it holds fewer than max_fields, and while its owner (the
-- node the figure is about: an engine's node, a link's destination) has fewer than max_per_owner: reports name
-- their own engines and links, so a reporter making names up would otherwise grow the hash, and every replica's
-- HGETALL of it, and, at max_fields, leave every other node's new engines and links on the cost model's defaults.
-- KEYS: one stats hash, its owner counts (hash: owner -> fields)
-- ARGV: alpha, max_fields, max_per_owner, field1, value1, owner1, field2, value2, owner2, ...
local alpha = tonumber(ARGV[1])
local max_fields = tonumber(ARGV[2])
local max_per_owner = tonumber(ARGV[3])
local size = redis.call('HLEN', KEYS[1])
local folded = 0
for i = 4, #ARGV, 3 do
  local sample = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  local new = sample
  if old then
    new = alpha * sample + (1 - alpha) * old
  end
  local admit = old ~= nil
  if not admit and size < max_fields and tonumber(redis.call('HGET', KEYS[2], ARGV[i + 2]) or '0') < max_per_owner then
    admit = true
    size = size + 1
    redis.call('HINCRBY', KEYS[2], ARGV[i + 2], 1)
  end
  if admit then
    redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', new))
    folded = folded + 1
  end
end
return folded
