-- Folds reported samples into exponentially weighted moving averages.
-- Read-modify-write in one script so two replicas folding samples at once never lose one.
-- A field the hash does not hold yet is added only while it holds fewer than max_fields, and while its owner (the
-- node the figure is about: an engine's node, a link's destination) has fewer than max_per_owner: reports name
-- their own engines and links, so a reporter making names up would otherwise grow the hash, and every replica's
-- HGETALL of it, and, at max_fields, leave every other node's new engines and links on the cost model's defaults.
-- One call (one report) moves a figure by at most a factor of max_step from what it was before the call (a field new
-- to the hash: from its first sample), however many samples of it the call carries: a node's made-up figure for
-- its own engine or link otherwise took the average there at once, and with it every route between its candidates.
-- KEYS: one stats hash, its owner counts (hash: owner -> fields)
-- ARGV: alpha, max_fields, max_per_owner, max_step, field1, value1, owner1, field2, value2, owner2, ...
local alpha = tonumber(ARGV[1])
local max_fields = tonumber(ARGV[2])
local max_per_owner = tonumber(ARGV[3])
local max_step = tonumber(ARGV[4])
local size = redis.call('HLEN', KEYS[1])
local folded = 0
local before = {}  -- field -> its value before this call (or its first sample here)
for i = 5, #ARGV, 3 do
  local sample = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  local new = sample
  if old then
    new = alpha * sample + (1 - alpha) * old
  end
  local base = before[ARGV[i]] or old or new
  before[ARGV[i]] = base
  new = math.min(math.max(new, base / max_step), base * max_step)
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
