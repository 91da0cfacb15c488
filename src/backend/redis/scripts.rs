//! Every Lua script the Redis backend runs, in one place (docs/stream-format.md explains the
//! keys they touch).
//!
//! All of them share two helpers, pasted in front of each script by [`with_helpers!`]:
//! - `life(key, fresh)`: the epoch of a stream and the position where that life began. The epoch
//!   is the name of a consumer group on the stream itself, `posthorn:epoch:<epoch>`, whose
//!   last-delivered id (never moved: nothing reads through the group) is the start. A stream
//!   without that group (new, deleted and re-created by an XADD, FLUSHALL, a restart without
//!   persistence) gets one now, named `fresh`, starting at `0`: everything in it is of the new
//!   life. Data and marker are one key, so losing the data loses the marker with it.
//! - `minid(retention_ms)`: the oldest id retention keeps, from Redis' own clock (`TIME`), never
//!   the pod's: a pod whose clock runs ahead must not trim what it just appended.
//! - `older(a, b)`: whether stream id `a` is below `b` (an unreadable one counts as older).
//! - `trimming(key)`: what tells how much of a stream was removed, `{last-generated-id,
//!   entries-added, length, max-deleted-entry-id, first entry id or ''}` (XINFO STREAM, Redis 7).

macro_rules! with_helpers {
    ($script:literal) => {
        concat!(
            r#"
local PREFIX = 'posthorn:epoch:'
local function life(key, fresh)
  if redis.call('EXISTS', key) == 1 then
    local best, start = nil, nil
    for _, group in ipairs(redis.call('XINFO', 'GROUPS', key)) do
      local name, delivered = nil, nil
      for i = 1, #group, 2 do
        if group[i] == 'name' then name = group[i + 1]
        elseif group[i] == 'last-delivered-id' then delivered = group[i + 1] end
      end
      if name and string.sub(name, 1, #PREFIX) == PREFIX then
        local epoch = string.sub(name, #PREFIX + 1)
        if best == nil or epoch < best then best, start = epoch, delivered end
      end
    end
    if best then return best, start end
  end
  redis.call('XGROUP', 'CREATE', key, PREFIX .. fresh, '0', 'MKSTREAM')
  return fresh, '0-0'
end
local function trimming(key)
  local info = redis.call('XINFO', 'STREAM', key)
  local fields = {}
  for f = 1, #info, 2 do fields[info[f]] = info[f + 1] end
  local first = ''
  if type(fields['first-entry']) == 'table' then first = fields['first-entry'][1] end
  return {fields['last-generated-id'], fields['entries-added'], fields['length'],
          fields['max-deleted-entry-id'], first}
end
local function older(a, b)
  local a_ms, a_seq = string.match(a, '^(%d+)-(%d+)$')
  local b_ms, b_seq = string.match(b, '^(%d+)-(%d+)$')
  if not a_ms or not b_ms then return true end
  a_ms, b_ms = tonumber(a_ms), tonumber(b_ms)
  return a_ms < b_ms or (a_ms == b_ms and tonumber(a_seq) < tonumber(b_seq))
end
local function minid(retention_ms)
  local now = redis.call('TIME')
  local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - retention_ms
  if ms < 0 then ms = 0 end
  return string.format('%.0f', ms)
end
"#,
            $script
        )
    };
}

/// Appends the items of one group. KEYS: the streams, supersede indexes and dedupe keys the items
/// refer to (one slot). ARGV: fresh epoch prefix, retention (ms), MAXLEN cap, dedupe window (ms),
/// item count, then per item: dedupe key index (0 = none), target (a device, `*`, or `@<group>`,
/// written as `grp <group>`), type, data, key, exp, sup ('' = none), stream count, then per stream its key index, shard and supersede index key index
/// (0 = none). An item with `sup` sets `<dev>/<sup>` of its shard's index to `<epoch> <id>`
/// with the entry, atomically. Returns per item the cursor of its first stream, whether it was
/// a duplicate, and for a broadcast the cursor of every copy in this group (else empty):
/// `{cursor, 0|1, {copy, ...}, ...}`. A dedupe key holds the cursor it was answered with (a
/// broadcast's: every copy of the group, space-separated, its cursor first), so a duplicate gets
/// the original's id and a retried broadcast its copies; a device's key answered in a life of its
/// stream that has ended is forgotten (its event was lost with that life). A dedupe window of 0
/// remembers nothing.
pub const APPEND: &str = with_helpers!(
    r#"
local out = {}
local threshold = minid(tonumber(ARGV[2]))
local lives = {}
local at = 6
for _ = 1, tonumber(ARGV[5]) do
  local dedupe = tonumber(ARGV[at])
  local dev, kind, data, key = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  local exp, sup = ARGV[at + 5], ARGV[at + 6]
  local streams = tonumber(ARGV[at + 7])
  local first = at + 8
  at = first + 3 * streams
  -- A group's target is '@<name>', stored as its own field: a pod that knows no groups
  -- skips the entry instead of taking it for a device's.
  local fields = {'dev', dev, 'type', kind, 'data', data}
  local group = string.sub(dev, 1, 1) == '@'
  -- A broadcast or a group event has a copy per shard; the fleet API compares acks with each.
  local per_shard = dev == '*' or group
  if group then fields = {'grp', string.sub(dev, 2), 'type', kind, 'data', data} end
  if key ~= '' then table.insert(fields, 'key'); table.insert(fields, key) end
  if exp ~= '' then table.insert(fields, 'exp'); table.insert(fields, exp) end
  if sup ~= '' then table.insert(fields, 'sup'); table.insert(fields, sup) end
  local previous = false
  if dedupe > 0 then
    previous = redis.call('GET', KEYS[dedupe])
    if previous then
      -- A device's event answered in a life of its stream that has ended since is lost, so its
      -- key is forgotten with it. A broadcast's copies on the group's other streams may well be
      -- there: its key stands (the lost copy's shard was told `data_lost`).
      local stream, shard = KEYS[tonumber(ARGV[first])], ARGV[first + 1]
      local epoch = lives[stream]
      if not epoch then
        epoch = life(stream, ARGV[1] .. shard)
        lives[stream] = epoch
      end
      if not per_shard and string.sub(previous, 1, #epoch + 1) ~= epoch .. '.' then previous = false end
    end
  end
  if previous then
    local answered = {}
    for copy in string.gmatch(previous, '%S+') do table.insert(answered, copy) end
    table.insert(out, answered[1])
    table.insert(out, 1)
    if per_shard then table.insert(out, answered) else table.insert(out, {}) end
  else
    local cursor = false
    local copies = {}
    for s = 0, streams - 1 do
      local stream = KEYS[tonumber(ARGV[first + 3 * s])]
      local shard = ARGV[first + 3 * s + 1]
      local index = tonumber(ARGV[first + 3 * s + 2])
      local epoch = lives[stream]
      if not epoch then
        epoch = life(stream, ARGV[1] .. shard)
        lives[stream] = epoch
      end
      local id = redis.call('XADD', stream, 'MINID', '~', threshold, '*', unpack(fields))
      if index > 0 then redis.call('HSET', KEYS[index], dev .. '/' .. sup, epoch .. ' ' .. id) end
      redis.call('XTRIM', stream, 'MAXLEN', '~', ARGV[3])
      if not cursor then cursor = epoch .. '.' .. shard .. '.' .. id end
      if per_shard then table.insert(copies, epoch .. '.' .. shard .. '.' .. id) end
    end
    if dedupe > 0 and ARGV[4] ~= '0' then
      local answer = cursor
      if per_shard then answer = table.concat(copies, ' ') end
      redis.call('SET', KEYS[dedupe], answer, 'PX', ARGV[4])
    end
    table.insert(out, cursor)
    table.insert(out, 0)
    table.insert(out, copies)
  end
end
return out
"#
);

/// The life and state of some streams of one group. KEYS: the streams. ARGV: fresh epoch prefix,
/// then per stream its shard and two positions to look for ('' = none): a cursor's, and the
/// newest one this pod knows was stored. Returns per stream `{epoch, start, trimming, found1,
/// found2}` with `trimming` as `trimming(key)` returns it and `found` 1 (stored), 0 (not stored)
/// or -1 (not asked). Entries themselves are not returned: they can be large.
pub const CHECK: &str = with_helpers!(
    r#"
local out = {}
for i, key in ipairs(KEYS) do
  local shard = ARGV[3 * i - 1]
  local epoch, start = life(key, ARGV[1] .. shard)
  local state = trimming(key)
  local found = {}
  for p = 1, 2 do
    local position = ARGV[3 * i - 1 + p]
    if position == '' then
      found[p] = -1
    elseif #redis.call('XRANGE', key, position, position) > 0 then
      found[p] = 1
    else
      found[p] = 0
    end
  end
  out[i] = {epoch, start, state, found[1], found[2]}
end
return out
"#
);

/// Starts a new life of a stream that went back in time, unless another pod did already.
/// KEYS[1]: the stream. ARGV: the epoch that lost data, the fresh epoch, and the position that
/// vanished ('' when the stream came back in a life that had already ended: that alone proves
/// the loss). The new life starts at the stream's current last id: what is stored up to there
/// belongs to the old one. Returns the current `{epoch, start}`.
pub const START_NEW_LIFE: &str = with_helpers!(
    r#"
local epoch, start = life(KEYS[1], ARGV[2])
if epoch == ARGV[1] and (ARGV[3] == '' or #redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3]) == 0) then
  redis.call('XGROUP', 'DESTROY', KEYS[1], PREFIX .. epoch)
  redis.call('XGROUP', 'CREATE', KEYS[1], PREFIX .. ARGV[2], '$')
  epoch, start = life(KEYS[1], ARGV[2])
end
return {epoch, start}
"#
);

/// One page of a stream with the life it belongs to and what trimming had removed when it was
/// read. KEYS[1]: the stream. ARGV: the exclusive start (`(id`), COUNT, the fresh epoch (shard
/// included). Returns `{epoch, entries, trimming}`.
pub const READ: &str = with_helpers!(
    r#"
local epoch = life(KEYS[1], ARGV[3])
return {epoch, redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2]), trimming(KEYS[1])}
"#
);

/// Retention for the streams of one group, by one pod at a time. KEYS[1]: the group's trim lease,
/// then per shard its stream and its supersede index. ARGV: this pod's token, lease length (ms),
/// retention (ms), MAXLEN cap. After trimming a stream, the index forgets the names whose newest
/// entry is gone (below the first entry, or of another life): nothing older is left to skip, and
/// the index stays as large as what is stored. Returns 1 when this pod holds the lease and
/// trimmed, 0 when another pod holds it.
pub const TRIM: &str = with_helpers!(
    r#"
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local threshold = minid(tonumber(ARGV[3]))
for i = 2, #KEYS, 2 do
  local stream, index = KEYS[i], KEYS[i + 1]
  redis.call('XTRIM', stream, 'MINID', '~', threshold)
  redis.call('XTRIM', stream, 'MAXLEN', '~', ARGV[4])
  if redis.call('EXISTS', index) == 1 then
    local head = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)
    if #head == 0 then
      redis.call('DEL', index)
    else
      local first, epoch = head[1][1], nil
      for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
        for g = 1, #group, 2 do
          if group[g] == 'name' and string.sub(group[g + 1], 1, #PREFIX) == PREFIX then
            local name = string.sub(group[g + 1], #PREFIX + 1)
            if epoch == nil or name < epoch then epoch = name end
          end
        end
      end
      local entries = redis.call('HGETALL', index)
      for e = 1, #entries, 2 do
        local life, id = string.match(entries[e + 1], '^(%S+) (%S+)$')
        if life ~= epoch or older(id, first) then redis.call('HDEL', index, entries[e]) end
      end
    end
  end
end
return 1
"#
);

/// Gives the trim lease up if this pod still holds it (compare and delete). KEYS[1]: the lease;
/// ARGV[1]: this pod's token.
pub const RELEASE_TRIM: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;
