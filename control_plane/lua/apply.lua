-- Sets (op 's') or clears (op 'r') tier bits of one node slot on runs of blocks,
-- in order, so one batch of events is one call.
-- When anything changed, the batch is appended to the namespace's change stream (read replicas replay it:
-- control_plane/replica.py) under the next sequence number, as stream id "<seq>-0": per run, the 8-byte keys
-- (first 8 bytes of the hash: what replicas index by) of the blocks that changed, in order.
-- KEYS: namespace block hash, its change stream, its change sequence counter
-- ARGV: slot, hash_len, then per run: op, tier_mask, concatenated hashes
-- Returns {number of block entries changed, the change's sequence number (0: nothing changed), blocks this slot
-- newly holds, blocks it no longer holds} (the last two keep the node's entry count: RedisBlockMap.node_entries).
local slot = tonumber(ARGV[1])
local hl = tonumber(ARGV[2])
local changed = 0
local added = 0
local dropped = 0
local record_runs = {}
for r = 3, #ARGV, 3 do
  local op = ARGV[r]
  local mask = tonumber(ARGV[r + 1])
  local blob = ARGV[r + 2]
  local run_keys = {}
  for i = 1, #blob, hl do
    local h = string.sub(blob, i, i + hl - 1)
    local v = redis.call('HGET', KEYS[1], h)
    local out = {}
    local found = false
    local dirty = false
    if v then
      for j = 1, #v, 2 do
        local hi, lo = string.byte(v, j, j + 1)
        local e = hi * 256 + lo
        local s = math.floor(e / 8)
        local m = e % 8
        if s == slot then
          found = true
          local nm
          if op == 's' then nm = bit.bor(m, mask) else nm = bit.band(m, 7 - mask) end
          if nm ~= m then dirty = true end
          if nm == 0 and m ~= 0 then dropped = dropped + 1 end
          m = nm
        end
        if m ~= 0 then
          local ne = s * 8 + m
          out[#out + 1] = string.char(math.floor(ne / 256), ne % 256)
        end
      end
    end
    if op == 's' and not found then
      local ne = slot * 8 + mask
      out[#out + 1] = string.char(math.floor(ne / 256), ne % 256)
      dirty = true
      added = added + 1
    end
    if dirty then
      changed = changed + 1
      run_keys[#run_keys + 1] = string.sub(h, 1, 8)
      if #out == 0 then
        redis.call('HDEL', KEYS[1], h)
      else
        redis.call('HSET', KEYS[1], h, table.concat(out))
      end
    end
  end
  if #run_keys > 0 then
    record_runs[#record_runs + 1] = ARGV[r] .. ARGV[r + 1] .. table.concat(run_keys)
  end
end
if changed == 0 then
  return {0, 0, 0, 0}
end
local seq = redis.call('INCR', KEYS[3])
local t = redis.call('TIME')
local record = {'t', 'a', 'ms', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 's', slot, 'hl', 8}
for i, run in ipairs(record_runs) do
  record[#record + 1] = tostring(i)
  record[#record + 1] = run
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1024, seq .. '-0', unpack(record))
return {changed, seq, added, dropped}
