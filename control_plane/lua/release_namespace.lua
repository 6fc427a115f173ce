-- Lets a namespace whose block map was found empty stop counting against its tenant's namespace limit, unless a
-- node claimed it within the last `quiet_ms` (a control plane that cached a claim writes without claiming again,
-- for at most a quarter of quiet_ms: such a namespace may be about to hold blocks again). A later claim counts it
-- anew.
-- KEYS: claims (hash), the tenant's namespaces (set), every namespace (set), then each node's namespaces (sets)
-- ARGV: the namespace's block-map key, quiet_ms
-- Returns 1 (released) or 0 (kept).
local claim = redis.call('HGET', KEYS[1], ARGV[1])
if not claim then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now - tonumber(string.match(claim, '^(%d+)')) < tonumber(ARGV[2]) then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
for i = 2, #KEYS do
  redis.call('SREM', KEYS[i], ARGV[1])
end
return 1
