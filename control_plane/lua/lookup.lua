-- Longest-prefix lookup. Reads blocks in order and stops at the first block
-- that extends no slot's run, so a lookup costs the matched prefix, not the prompt.
-- KEYS: namespace block hash   ARGV: hash_len, concatenated hashes, tier filter mask
-- Returns {blocks_read, slot, any_count, gpu_count, cpu_count, disk_count, slot, ...}
-- Counts are leading blocks: "any" on any filtered tier, the others per tier.
local hl = tonumber(ARGV[1])
local blob = ARGV[2]
local filter = tonumber(ARGV[3])
local counts = {}   -- slot -> {any, gpu, cpu, disk}
local running = {}  -- slot -> {any, gpu, cpu, disk} booleans
local order = {}
local read = 0
for i = 1, #blob, hl do
  local v = redis.call('HGET', KEYS[1], string.sub(blob, i, i + hl - 1))
  if not v then break end
  local present = {}
  for j = 1, #v, 2 do
    local hi, lo = string.byte(v, j, j + 1)
    local e = hi * 256 + lo
    local m = bit.band(e % 8, filter)
    if m ~= 0 then present[math.floor(e / 8)] = m end
  end
  if read == 0 then
    for s, _ in pairs(present) do
      counts[s] = {0, 0, 0, 0}
      running[s] = {true, true, true, true}
      order[#order + 1] = s
    end
  end
  local extended = false
  for _, s in ipairs(order) do
    local r = running[s]
    if r[1] then
      local m = present[s]
      local c = counts[s]
      if m then
        extended = true
        c[1] = c[1] + 1
        for k = 0, 2 do
          if r[k + 2] then
            if bit.band(m, bit.lshift(1, k)) ~= 0 then c[k + 2] = c[k + 2] + 1 else r[k + 2] = false end
          end
        end
      else
        r[1] = false
      end
    end
  end
  if not extended then break end
  read = read + 1
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
return out
