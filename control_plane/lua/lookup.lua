-- Longest-prefix lookup. Reads blocks in order, in HMGET chunks that double in
-- size, and stops at the first block that extends no slot's run: a lookup costs
-- the matched prefix (plus at most one chunk), not the whole prompt.
-- A block whose value equals the previous block's (same holders, same tiers: the
-- common case along a shared prefix) extends the same runs, so it is only compared.
-- KEYS: namespace block hash [, live-slot table (single server only: saves a round trip)]
-- ARGV: hash_len, concatenated hashes, tier filter mask
-- Returns {{blocks_read, slot, any_count, gpu_count, cpu_count, disk_count, slot, ...},
--          [the live-slot records of those slots, in that order (false: not in the table), the server time in ms]}
-- Only the holders' records are read: a lookup's cost does not grow with the number of nodes in the fleet.
-- Counts are leading blocks: "any" on any filtered tier, the others per tier.
local hl = tonumber(ARGV[1])
local blob = ARGV[2]
local filter = tonumber(ARGV[3])
local n = #blob / hl
local counts = {}   -- slot -> {any, gpu, cpu, disk}
local running = {}  -- slot -> {any, gpu, cpu, disk} booleans
local order = {}

local function decode(v)
  local present = {}
  for j = 1, #v, 2 do
    local hi, lo = string.byte(v, j, j + 1)
    local e = hi * 256 + lo
    local m = bit.band(e % 8, filter)
    if m ~= 0 then present[math.floor(e / 8)] = m end
  end
  return present
end

-- Credits `times` consecutive blocks held as `present`; false if no run grew.
local function credit(present, times)
  local extended = false
  for _, s in ipairs(order) do
    local r = running[s]
    if r[1] then
      local m = present[s]
      local c = counts[s]
      if m then
        extended = true
        c[1] = c[1] + times
        for k = 0, 2 do
          if r[k + 2] then
            if bit.band(m, bit.lshift(1, k)) ~= 0 then c[k + 2] = c[k + 2] + times else r[k + 2] = false end
          end
        end
      else
        r[1] = false
      end
    end
  end
  return extended
end

-- The common case is a block whose value equals the previous one: it costs one comparison. Such a run is
-- credited in bulk when it ends (run_from: the index of the run's first block, which was credited alone).
local read = 0
local prev, prev_present = nil, nil
local run_from = -1
local chunk = 32
local i = 0
local done = false
while not done and i < n do
  local m = math.min(chunk, n - i)
  local fields = {}
  local off = i * hl
  for k = 1, m do
    fields[k] = string.sub(blob, off + 1, off + hl)
    off = off + hl
  end
  local vals = redis.call('HMGET', KEYS[1], unpack(fields))
  for k = 1, m do
    local v = vals[k]
    if v ~= prev then
      local at = i + k - 1
      if at - run_from > 1 then credit(prev_present, at - run_from - 1) end
      read = at
      if not v then done = true break end
      local present = decode(v)
      if at == 0 then
        for s, _ in pairs(present) do
          counts[s] = {0, 0, 0, 0}
          running[s] = {true, true, true, true}
          order[#order + 1] = s
        end
      end
      if not credit(present, 1) then done = true break end
      prev, prev_present, run_from = v, present, at
    end
  end
  i = i + m
  chunk = chunk * 2
end
if not done then
  read = n
  if n - run_from > 1 then credit(prev_present, n - run_from - 1) end
end

local out = {read}
for _, s in ipairs(order) do
  local c = counts[s]
  out[#out + 1] = s
  out[#out + 1] = c[1]
  out[#out + 1] = c[2]
  out[#out + 1] = c[3]
  out[#out + 1] = c[4]
end
if KEYS[2] then
  local t = redis.call('TIME')
  local records = {}
  if #order > 0 then records = redis.call('HMGET', KEYS[2], unpack(order)) end
  return {out, records, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
end
return {out}
