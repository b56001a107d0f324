"""Server-side Lua scripts of the block index; the key schema they share is in docs/redis_index.md.

Invariants the scripts keep together:
- `node:<id>`'s `epoch` field is the node's current epoch; `alive:<id>` (TTL = heartbeat TTL) holds that epoch
  while the node heartbeats; block records live in `blk:<id>:<epoch>`, so records of an older epoch are never
  read, and they are deleted when the node registers again (or expire with the records TTL).
- A write (publish, heartbeat) names the node's epoch; STALE refuses one that is not the current one.
- Lookup and nodes read only: they never create or change a key.
- Every script takes the key prefix as ARGV[1] and declares the cluster's `nodes` key, so all keys share one
  hash tag (one Redis Cluster slot).
- Scripts answer with a status word first ('OK', 'STALE', 'UNREGISTERED', 'INCOMPATIBLE') rather than Lua
  errors, so callers map outcomes without parsing error text.
- `blkdig:<id>:<epoch>` (fields a, b) is the XOR of the first two little-endian int32 words of every member
  of `blk:<id>:<epoch>`: every script that adds or removes a member updates it in the same call (only for
  members actually added or removed), deletes it with the set and gives it the set's TTL, so a node compares
  its held set with the index in O(1) (shared/index/block_digest.py).
"""

# The node's epoch check of a write or digest read (ARGV: prefix, node_id, epoch, ...).
_CURRENT_EPOCH = """
local p, id, epoch = ARGV[1], ARGV[2], ARGV[3]
local current = redis.call('HGET', p .. 'node:' .. id, 'epoch')
if not current then return {'UNREGISTERED'} end
if current ~= epoch then return {'STALE', current} end
"""

# apply(key, dig, op, hashes): SADD ('S') or SREM ('R') of hashes (at most 1,000), XOR-ing into dig (a
# two-element table) exactly the members that change; a hash twice in one call counts once.
_APPLY = """
local function apply(key, dig, op, hashes)
  local r = redis.call('SMISMEMBER', key, unpack(hashes))
  local want = (op == 'S') and 0 or 1
  local changed, seen = {}, {}
  for k, h in ipairs(hashes) do
    if r[k] == want and not seen[h] and #h >= 8 then
      seen[h] = true
      changed[#changed + 1] = h
      local x, y = struct.unpack('<i4i4', h)
      dig[1], dig[2] = bit.bxor(dig[1], x), bit.bxor(dig[2], y)
    end
  end
  if #changed > 0 then redis.call((op == 'S') and 'SADD' or 'SREM', key, unpack(changed)) end
  return #changed
end
local function load_dig(dkey)
  local d = redis.call('HMGET', dkey, 'a', 'b')
  return {tonumber(d[1]) or 0, tonumber(d[2]) or 0}
end
-- Writes dig beside the records key (or drops it with an empty set); ttl_ms: the records' new TTL, or nil to
-- give the digest the records' current one.
local function save_dig(key, dkey, dig, ttl_ms)
  if redis.call('EXISTS', key) == 0 then
    redis.call('DEL', dkey)
    return
  end
  redis.call('HSET', dkey, 'a', dig[1], 'b', dig[2])
  if ttl_ms then
    redis.call('PEXPIRE', key, ttl_ms)
  else
    ttl_ms = redis.call('PTTL', key)
  end
  if tonumber(ttl_ms) > 0 then redis.call('PEXPIRE', dkey, ttl_ms) end
end
"""

_NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# ARGV: prefix, node_id, info_json, records_ttl_ms, last epoch the node had (0: none; the new epoch is above
# it even when Redis lost the counter), then (field, value) pairs that must match the cluster's recorded ones
# while another node is live. The node is not live (no `alive:` key at the new epoch) until its first
# heartbeat, which carries the record's signature.
REGISTER = (
    _NOW_MS
    + """
local p, id = ARGV[1], ARGV[2]
local live = false
for _, other in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', p .. 'node:' .. other) == 0 then
    redis.call('SREM', KEYS[1], other)
  elseif other ~= id and redis.call('EXISTS', p .. 'alive:' .. other) == 1 then
    live = true
  end
end
local cluster = p .. 'cluster'
if live then
  for i = 6, #ARGV, 2 do
    local recorded = redis.call('HGET', cluster, ARGV[i])
    if recorded and recorded ~= ARGV[i + 1] then
      return {'INCOMPATIBLE', ARGV[i], ARGV[i + 1], recorded}
    end
  end
else
  redis.call('DEL', cluster)
end
for i = 6, #ARGV, 2 do redis.call('HSET', cluster, ARGV[i], ARGV[i + 1]) end
local key = p .. 'node:' .. id
local old = redis.call('HGET', key, 'epoch')
if old then redis.call('UNLINK', p .. 'blk:' .. id .. ':' .. old, p .. 'blkdig:' .. id .. ':' .. old) end
local epoch = redis.call('INCR', p .. 'epoch:' .. id)
if epoch <= tonumber(ARGV[5]) then
  epoch = tonumber(ARGV[5]) + 1
  redis.call('SET', p .. 'epoch:' .. id, epoch)
end
redis.call('DEL', key, p .. 'alive:' .. id)
redis.call('HSET', key, 'info', ARGV[3], 'epoch', epoch, 'load', '', 'sig', '', 'hb_ms', now_ms())
redis.call('PEXPIRE', key, ARGV[4])
redis.call('SADD', KEYS[1], id)
return {'OK', epoch}
"""
)

# ARGV: prefix, node_id, load_json, heartbeat_ttl_ms, records_ttl_ms, epoch, signature (of the record with
# this load: block_index.py). Every beat rewrites the node's whole signed state, so a field written by anyone
# else lasts one heartbeat at most.
HEARTBEAT = (
    _NOW_MS
    + """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'node:' .. id
local epoch = redis.call('HGET', key, 'epoch')
if not epoch then return {'UNREGISTERED'} end
if ARGV[6] ~= epoch then return {'STALE', epoch} end
redis.call('HSET', key, 'load', ARGV[3], 'sig', ARGV[7], 'hb_ms', now_ms())
redis.call('PEXPIRE', key, ARGV[5])
redis.call('SET', p .. 'alive:' .. id, epoch, 'PX', ARGV[4])
redis.call('PEXPIRE', p .. 'blk:' .. id .. ':' .. epoch, ARGV[5])
redis.call('PEXPIRE', p .. 'blkdig:' .. id .. ':' .. epoch, ARGV[5])
return {'OK', epoch}
"""
)

# ARGV: prefix, node_id, epoch, records_ttl_ms, then ops in order: 'S' n h1..hn (stored), 'R' n h1..hn
# (removed), 'C' 0 (clear every record of the node, for a full resync).
PUBLISH = (
    _APPLY
    + _CURRENT_EPOCH
    + """
local key = p .. 'blk:' .. id .. ':' .. epoch
local dkey = p .. 'blkdig:' .. id .. ':' .. epoch
local dig = load_dig(dkey)
local i = 5
while i <= #ARGV do
  local op, last = ARGV[i], i + 1 + tonumber(ARGV[i + 1])
  if op == 'C' then
    redis.call('DEL', key)
    dig = {0, 0}
  end
  local s = i + 2
  while s <= last do
    local e = math.min(last, s + 999)
    apply(key, dig, op, {unpack(ARGV, s, e)})
    s = e + 1
  end
  i = last + 1
end
save_dig(key, dkey, dig, ARGV[4])
return {'OK', redis.call('SCARD', key)}
"""
)

# ARGV: prefix, node_id, epoch. Answer: {'OK', records, a, b} (the digest of the node's records).
DIGEST = (
    _CURRENT_EPOCH
    + """
local d = redis.call('HMGET', p .. 'blkdig:' .. id .. ':' .. epoch, 'a', 'b')
local n = redis.call('SCARD', p .. 'blk:' .. id .. ':' .. epoch)
return {'OK', n, tonumber(d[1]) or 0, tonumber(d[2]) or 0}
"""
)

# ARGV: prefix, node_id, epoch. Recomputes the digest from the records (O(records): after a full comparison
# found the records right but the digest wrong, e.g. records written before digests existed).
REBUILD_DIGEST = (
    _APPLY
    + _CURRENT_EPOCH
    + """
local key = p .. 'blk:' .. id .. ':' .. epoch
local a, b = 0, 0
for _, h in ipairs(redis.call('SMEMBERS', key)) do
  if #h >= 8 then
    local x, y = struct.unpack('<i4i4', h)
    a, b = bit.bxor(a, x), bit.bxor(b, y)
  end
end
save_dig(key, p .. 'blkdig:' .. id .. ':' .. epoch, {a, b}, nil)
return {'OK', redis.call('SCARD', key)}
"""
)

# ARGV: prefix, h_0 || h_1 || ... (the hashes concatenated: one Lua string, not one per block). Answer:
# flat (node_id, prefix_blocks) pairs of live nodes holding block 0. A node is probed with one SISMEMBER on
# block 0; a holder then runs SMISMEMBER over growing chunks (16, 64, 256, 1024) up to its first missing
# block, so a cold node costs one call and a holder of n blocks about log4(n) calls checking ~n hashes in C.
LOOKUP = """
local p, blob = ARGV[1], ARGV[2]
local n = #blob / 32
local ids = redis.call('SMEMBERS', KEYS[1])
if #ids == 0 or n == 0 then return {} end
local keys = {}
for i, id in ipairs(ids) do keys[i] = p .. 'alive:' .. id end
local epochs = redis.call('MGET', unpack(keys))
local first = string.sub(blob, 1, 32)
local out = {}
for i, id in ipairs(ids) do
  local key = epochs[i] and (p .. 'blk:' .. id .. ':' .. epochs[i])
  if key and redis.call('SISMEMBER', key, first) == 1 then
    local held, start, step = 1, 1, 16
    while start < n do
      local last = math.min(n, start + step) - 1
      local chunk = {}
      for j = start, last do chunk[#chunk + 1] = string.sub(blob, 32 * j + 1, 32 * j + 32) end
      local r = redis.call('SMISMEMBER', key, unpack(chunk))
      local k = 1
      while k <= #r and r[k] == 1 do k = k + 1 end
      held = held + k - 1
      if k <= #r then break end
      start = last + 1
      step = math.min(step * 4, 1024)
    end
    out[#out + 1] = id
    out[#out + 1] = held
  end
end
return out
"""

# ARGV: prefix. Answer: now_ms, then per live node: id, info_json, epoch, load_json, hb_ms, signature,
# records. Values are passed as Redis holds them (a field may be missing: false); the caller verifies them.
NODES = (
    _NOW_MS
    + """
local p = ARGV[1]
local out = {now_ms()}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local alive = redis.call('GET', p .. 'alive:' .. id)
  local f = redis.call('HMGET', p .. 'node:' .. id, 'info', 'epoch', 'load', 'hb_ms', 'sig')
  if alive and f[2] == alive then
    local records = redis.call('SCARD', p .. 'blk:' .. id .. ':' .. alive)
    for _, v in ipairs({id, f[1], f[2], f[3], f[4], f[5], records}) do out[#out + 1] = v end
  end
end
return out
"""
)

# ARGV: prefix, node_id. Answer: 1 if the node was registered, else 0.
DEREGISTER = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'node:' .. id
local epoch = redis.call('HGET', key, 'epoch')
redis.call('SREM', KEYS[1], id)
redis.call('DEL', p .. 'alive:' .. id)
if not epoch then return 0 end
redis.call('UNLINK', p .. 'blk:' .. id .. ':' .. epoch, p .. 'blkdig:' .. id .. ':' .. epoch)
redis.call('DEL', key)
return 1
"""

# ARGV: prefix, node_id, then hashes to drop (none = all records). Answer: {'OK', records removed}.
EVICT_RECORDS = (
    _APPLY
    + """
local p, id = ARGV[1], ARGV[2]
local epoch = redis.call('HGET', p .. 'node:' .. id, 'epoch')
if not epoch then return {'UNREGISTERED'} end
local key = p .. 'blk:' .. id .. ':' .. epoch
local dkey = p .. 'blkdig:' .. id .. ':' .. epoch
if #ARGV == 2 then
  local n = redis.call('SCARD', key)
  redis.call('UNLINK', key, dkey)
  return {'OK', n}
end
local dig = load_dig(dkey)
local removed, s = 0, 3
while s <= #ARGV do
  local e = math.min(#ARGV, s + 999)
  removed = removed + apply(key, dig, 'R', {unpack(ARGV, s, e)})
  s = e + 1
end
save_dig(key, dkey, dig, nil)
return {'OK', removed}
"""
)
