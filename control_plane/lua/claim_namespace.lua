-- Records that a node writes blocks of a namespace; refuses a namespace new to its tenant once the tenant has
-- `limit` of them. Check and add in one script, so concurrent claims (two replicas, two streams) never pass it.
-- The claim's time goes to the claims hash: release_namespace.lua lets a namespace go only once no claim was made
-- for longer than any control plane keeps a claim in its cache.
-- A negative limit, -N: the limit N, and the node opens at most half of it (at least one): counted as the tenant's
-- namespaces it claimed (the tenant's set and the node's), so that one node's key cannot open made-up models up to
-- the limit and leave the tenant's other nodes unable to open a new one (control_plane.core._claim_namespace).
-- KEYS: every namespace (set), the tenant's namespaces (set), the node's namespaces (set), claims (hash)
-- ARGV: the namespace's block-map key, limit (0: none; -N: N, with the node's share), tenant
-- Returns 1 (recorded) or 0 (refused, nothing recorded).
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 then
  local limit = tonumber(ARGV[2])
  local share = 0
  if limit < 0 then
    limit = -limit
    share = math.max(1, math.floor(limit / 2))
  end
  if limit > 0 and redis.call('SCARD', KEYS[2]) >= limit then
    return 0
  end
  if share > 0 and redis.call('SINTERCARD', 2, KEYS[2], KEYS[3], 'LIMIT', share) >= share then
    return 0
  end
  redis.call('SADD', KEYS[2], ARGV[1])
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
local t = redis.call('TIME')
redis.call('HSET', KEYS[4], ARGV[1], (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) .. '\t' .. ARGV[3])
return 1
