-- Removes tier bits of given slots from one chunk of a namespace's blocks.
-- Used to garbage-collect retired slots and to clear one tier of a node.
-- The clear is appended to the namespace's change stream on the first chunk and again on the last (a replica
-- that loaded the hash while a sweep was under way then still drops the bits; clearing twice is harmless).
-- KEYS: namespace block hash, its change stream, its change sequence counter
-- ARGV: cursor, count, slot, mask, slot, mask, ...
-- Returns {the next HSCAN cursor ("0" when the namespace is done), blocks of this chunk a cleared slot no longer
-- holds (a tier clear takes them off the node's entry count)}.
local clear = {}
for i = 3, #ARGV, 2 do
  clear[tonumber(ARGV[i])] = tonumber(ARGV[i + 1])
end
local res = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local dropped = 0
local fields = res[2]
for i = 1, #fields, 2 do
  local h = fields[i]
  local v = fields[i + 1]
  local out = {}
  local dirty = false
  for j = 1, #v, 2 do
    local hi, lo = string.byte(v, j, j + 1)
    local e = hi * 256 + lo
    local s = math.floor(e / 8)
    local m = e % 8
    local c = clear[s]
    if c then
      local nm = bit.band(m, 7 - c)
      if nm ~= m then dirty = true end
      if nm == 0 and m ~= 0 then dropped = dropped + 1 end
      m = nm
    end
    if m ~= 0 then
      local ne = s * 8 + m
      out[#out + 1] = string.char(math.floor(ne / 256), ne % 256)
    end
  end
  if dirty then
    if #out == 0 then redis.call('HDEL', KEYS[1], h) else redis.call('HSET', KEYS[1], h, table.concat(out)) end
  end
end
if ARGV[1] == '0' or res[1] == '0' then
  local seq = redis.call('INCR', KEYS[3])
  local t = redis.call('TIME')
  local pairs_ = {}
  for i = 3, #ARGV do pairs_[#pairs_ + 1] = ARGV[i] end
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1024, seq .. '-0', 't', 'c',
             'ms', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 'c', table.concat(pairs_, ','))
end
return {res[1], dropped}
