"""Lua sources of the lease scripts (one script per operation, one round trip each).

Common calling convention::

    KEYS[1] epoch   KEYS[2] fence counter   KEYS[3] index zset   KEYS[4..] lease hash(es)
    ARGV[1] epoch candidate (fresh random u63 per call; used only if the epoch key is absent)
    ARGV[2] tombstone grace ms   ARGV[3] namespace prefix ``{ns}:``   ARGV[4] events MAXLEN
    ARGV[5] lease id             ARGV[6..] operation arguments

A lease hash is named ``{ns}:lease:<ref>``, where ``ref = sha1hex("{ns}:lease:" .. lease id)``:
the key name does not give the lease id, and every script that acts on one lease first checks
that its key is the one its lease id names (``BADKEY`` otherwise), so a caller who only read
key names from the keyspace cannot act through these scripts. The index and the events carry
the ref, never the lease id.

Lease hash fields: st (P published, C claimed, R released, A aborted, V revoked,
X expired), ow owner, cl claimer, ep epoch, fc fence counter, cu claim expiry ms,
ex lease expiry ms (server clock), nb blocks, mt meta JSON, pn publish nonce.
A claimed lease whose ``cu`` passed is effectively P; a P/C lease whose ``ex``
passed is effectively X. Terminal records stay ``grace`` ms as tombstones, so a
late caller learns "expired/released" rather than "not found".

Replies: a lease view is one JSON string (cheap to parse: one bulk reply)
``[ref, state, owner, claimer, epoch, fence counter, lease ms left, claim ms left,
blocks, meta json]``; other replies are arrays ``{'OK', ...}`` or ``{CODE, detail}``, CODE one of
EXISTS NOTFOUND EXPIRED REVOKED ENDED CONFLICT STALE LAPSED EPOCH NOTOWNER BADKEY.
The events stream key (prefix .. owner), the lease keys built by ``list`` and the epoch's
run-id key (``KEYS[1] .. ':run'``) are not passed in KEYS: they share the namespace hash tag,
hence the slot.

The epoch is new whenever the server process is (its ``run_id`` differs from the one stored
with the epoch): a restart that loaded a snapshot older than the last writes, or a replica
promoted by failover, would otherwise hand out fences already used and revive leases already
released. Every lease of the namespace then ends, as on a restart that lost its data.
"""

from __future__ import annotations

PRELUDE = r"""
local K_EPOCH, K_FENCE, K_IDX, K_LEASE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local GRACE = tonumber(ARGV[2])
local LPREFIX, EVPREFIX = ARGV[3] .. 'lease:', ARGV[3] .. 'events:'
local EVMAX, ID = ARGV[4], ARGV[5]
local REF = ''   -- set by ONE: the public name of the lease (sha1 of its key's id)
local EVTTL = 3600000
local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- A dataset this server process did not create may be older than the last writes (a restart
-- that loaded a snapshot, a replica promoted by failover): its fence counter and leases may be
-- ones already used. So the epoch belongs to a server process (its run id) as well as a dataset.
local RUN = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
local EPOCH = redis.call('GET', K_EPOCH)
if not EPOCH or redis.call('GET', K_EPOCH .. ':run') ~= RUN then
  EPOCH = ARGV[1]
  redis.call('SET', K_EPOCH, EPOCH)
  redis.call('SET', K_EPOCH .. ':run', RUN)
end

local function load(key)
  local v = redis.call('HMGET', key, 'st', 'ow', 'cl', 'ep', 'fc', 'cu', 'ex', 'nb', 'mt', 'pn')
  if not v[1] then return nil end
  return {st=v[1], ow=v[2], cl=v[3], ep=v[4], fc=tonumber(v[5]), cu=tonumber(v[6]),
          ex=tonumber(v[7]), nb=v[8], mt=v[9], pn=v[10]}
end

local function eff(h)
  if h.ep ~= EPOCH then return 'X' end
  local s = h.st
  if (s == 'P' or s == 'C') and NOW >= h.ex then return 'X' end
  if s == 'C' and NOW >= h.cu then return 'P' end
  return s
end

local function emit(owner, kind)
  local k = EVPREFIX .. owner
  redis.call('XADD', k, 'MAXLEN', '~', EVMAX, '*', 'k', kind, 'id', REF)
  redis.call('PEXPIRE', k, EVTTL)
end

local function settle(h)
  local s = eff(h)
  if s == 'X' and h.st ~= 'X' then
    redis.call('HSET', K_LEASE, 'st', 'X')
    emit(h.ow, 'expired')
  end
  return s
end

local function keep_until(at)
  redis.call('PEXPIREAT', K_LEASE, at)
  redis.call('ZADD', K_IDX, at, REF)
end

local function view(ref, h, s)
  local cl, left, cleft = h.cl, 0, 0
  if s == 'P' then cl = '' end
  if s == 'P' or s == 'C' then left = h.ex - NOW end
  if s == 'C' then cleft = h.cu - NOW end
  return cjson.encode({ref, s, h.ow, cl, h.ep, string.format('%d', h.fc),
                       string.format('%d', left), string.format('%d', cleft), h.nb, h.mt})
end

local function gone(s)
  if s == 'X' then return {'EXPIRED'} end
  if s == 'V' then return {'REVOKED'} end
  return nil
end

-- claimer-side checks: ARGV[6] claimer, ARGV[7] fence epoch, ARGV[8] fence counter
local function holder()
  if ARGV[7] ~= EPOCH then return nil, nil, {'EPOCH'} end
  local h = load(K_LEASE)
  if not h then return nil, nil, {'EXPIRED'} end
  local s = settle(h)
  local g = gone(s)
  if g then return nil, nil, g end
  if h.cl ~= ARGV[6] then return nil, nil, {'CONFLICT', h.cl} end
  if h.fc ~= tonumber(ARGV[8]) then return nil, nil, {'STALE'} end
  if s == 'P' then return nil, nil, {'LAPSED'} end
  return h, s, nil
end
"""

# Scripts on one lease (all but SWEEP and LIST, which only read) start with this check:
# the lease's key must be the one its id names -- knowing a key name is not knowing the id.
ONE = PRELUDE + r"""
REF = redis.sha1hex(LPREFIX .. ID)
if K_LEASE ~= LPREFIX .. REF then return {'BADKEY'} end
"""

# ARGV[6] owner, [7] ttl ms, [8] num blocks, [9] meta json, [10] nonce
PUBLISH = ONE + r"""
local h = load(K_LEASE)
if h then
  if h.ow == ARGV[6] and h.pn == ARGV[10] and h.ep == EPOCH then
    local s = settle(h)
    local g = gone(s)
    if g then return g end
    return view(REF, h, s)
  end
  return {'EXISTS', h.ow}
end
local c = redis.call('INCR', K_FENCE)
local ex = NOW + tonumber(ARGV[7])
redis.call('HSET', K_LEASE, 'st', 'P', 'ow', ARGV[6], 'cl', '', 'ep', EPOCH, 'fc', c,
           'cu', 0, 'ex', ex, 'nb', ARGV[8], 'mt', ARGV[9], 'pn', ARGV[10])
keep_until(ex + GRACE)
redis.call('ZREMRANGEBYSCORE', K_IDX, '-inf', NOW)
h = {st='P', ow=ARGV[6], cl='', ep=EPOCH, fc=c, cu=0, ex=ex, nb=ARGV[8], mt=ARGV[9]}
return view(REF, h, 'P')
"""

# ARGV[6] claimer, [7] claim ttl ms
CLAIM = ONE + r"""
local h = load(K_LEASE)
if not h then return {'NOTFOUND'} end
local s = settle(h)
local g = gone(s)
if g then return g end
if s == 'R' or s == 'A' then return {'ENDED', s} end
local cu = math.min(NOW + tonumber(ARGV[7]), h.ex)
if s == 'C' then
  if h.cl ~= ARGV[6] then return {'CONFLICT', h.cl} end
  if cu > h.cu then
    h.cu = cu
    redis.call('HSET', K_LEASE, 'cu', cu)
  end
  return view(REF, h, 'C')
end
local c = redis.call('INCR', K_FENCE)
h.st, h.cl, h.fc, h.cu = 'C', ARGV[6], c, cu
redis.call('HSET', K_LEASE, 'st', 'C', 'cl', ARGV[6], 'fc', c, 'cu', cu)
return view(REF, h, 'C')
"""

# ARGV[6..8] claimer, fence
VALIDATE = ONE + r"""
local h, s, err = holder()
if err then return err end
if s ~= 'C' then return {'ENDED', s} end
return {'OK'}
"""


def _finish(code: str, kind: str, done: str, notify: bool = True) -> str:
    """RELEASE or ABORT. ``done``: the ended states in which this one answers OK again (a retry);
    a release after the holder's own abort is refused -- a release is the read's validation.
    ``notify=False``: no event for the owner (the owner itself releases, for its reader)."""
    return ONE + f"""
local h, s, err = holder()
if err then return err end
if {' or '.join(f"s == '{d}'" for d in done)} then return {{'OK', s}} end
if s == 'R' or s == 'A' then return {{'ENDED', s}} end
redis.call('HSET', K_LEASE, 'st', '{code}')
keep_until(NOW + GRACE)
{f"emit(h.ow, '{kind}')" if notify else "-- the owner makes this release itself: no event to wake it"}
return {{'OK', '{code}'}}
"""


RELEASE = _finish("R", "released", "R")
RELEASE_QUIET = _finish("R", "released", "R", notify=False)
ABORT = _finish("A", "aborted", "RA")

# ARGV[6..8] claimer, fence; ARGV[9] claim ttl ms
RENEW_CLAIM = ONE + r"""
local h, s, err = holder()
if err then return err end
if s ~= 'C' then return {'ENDED', s} end
local cu = math.min(NOW + tonumber(ARGV[9]), h.ex)
if cu > h.cu then
  h.cu = cu
  redis.call('HSET', K_LEASE, 'cu', cu)
end
return view(REF, h, s)
"""

# ARGV[6] owner, [7] ttl ms
RENEW_OWNER = ONE + r"""
local h = load(K_LEASE)
if not h then return {'NOTFOUND'} end
if h.ow ~= ARGV[6] then return {'NOTOWNER', h.ow} end
local s = settle(h)
local g = gone(s)
if g then return g end
if s == 'P' or s == 'C' then
  local ex = NOW + tonumber(ARGV[7])
  if ex > h.ex then
    h.ex = ex
    redis.call('HSET', K_LEASE, 'ex', ex)
    keep_until(ex + GRACE)
  end
end
return view(REF, h, s)
"""

# ARGV[6] owner
REVOKE = ONE + r"""
local h = load(K_LEASE)
if not h then return {'OK', ''} end
if h.ow ~= ARGV[6] then return {'NOTOWNER', h.ow} end
local s = settle(h)
if s == 'P' or s == 'C' then
  redis.call('HSET', K_LEASE, 'st', 'V')
  keep_until(NOW + GRACE)
  emit(h.ow, 'revoked')
end
return {'OK', s}
"""

GET = ONE + r"""
local h = load(K_LEASE)
if not h then return {'NOTFOUND'} end
local s = eff(h)
if gone(s) then return {'NOTFOUND'} end
return view(REF, h, s)
"""

# KEYS[4..] lease keys; ARGV[6] owner. Reply: one state letter per key ('' = gone/not owned).
SWEEP = PRELUDE + r"""
local out = {}
for i = 4, #KEYS do
  local h = load(KEYS[i])
  local s = ''
  if h and h.ow == ARGV[6] then
    s = eff(h)
    if gone(s) then s = '' end
  end
  out[#out + 1] = s
end
return out
"""

# One page of the index: a script blocks the whole server while it runs, so it looks at most
# ARGV[10] index entries, from the cursor (ARGV[8] score, ARGV[9] entries of that score already
# seen; '-inf', 0 to begin) on. ARGV[6] owner ('' = all), [7] most views to return.
# Reply: {next score ('' = the index is done), next offset, view, view, ...}.
LIST = PRELUDE + r"""
if ARGV[8] == '-inf' then redis.call('ZREMRANGEBYSCORE', K_IDX, '-inf', NOW) end
local page = redis.call('ZRANGE', K_IDX, ARGV[8], '+inf', 'BYSCORE', 'LIMIT', tonumber(ARGV[9]),
                        tonumber(ARGV[10]), 'WITHSCORES')
local out, limit = {'', '0'}, tonumber(ARGV[7]) + 2
local score, off = ARGV[8], tonumber(ARGV[9])
for i = 1, #page, 2 do
  local ref = page[i]
  if page[i + 1] == score then off = off + 1 else score, off = page[i + 1], 1 end
  local h = load(LPREFIX .. ref)
  if h and (ARGV[6] == '' or h.ow == ARGV[6]) then
    local s = eff(h)
    if not gone(s) then out[#out + 1] = view(ref, h, s) end
  end
  if #out >= limit then break end
end
if #page == 2 * tonumber(ARGV[10]) or #out >= limit then
  out[1], out[2] = score, string.format('%d', off)
end
return out
"""

ALL = {
    "publish": PUBLISH, "claim": CLAIM, "validate": VALIDATE, "release": RELEASE, "release_quiet": RELEASE_QUIET,
    "abort": ABORT, "renew_claim": RENEW_CLAIM, "renew_owner": RENEW_OWNER,
    "revoke": REVOKE, "get": GET, "sweep": SWEEP, "list": LIST,
}
