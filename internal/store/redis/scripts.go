package redisstore

import "github.com/redis/go-redis/v9"

// A record is one HASH at prefix+key:
//
//	s  state: "p" pending, "c" completed
//	fp fingerprint of the call
//	o  owner token (kept once completed, see n)
//	l  lease expiry, Redis server time in Unix milliseconds (pending only)
//	r  the response (completed only)
//	n  nonce of the Complete that stored r, so that a Complete that go-redis
//	   re-sends after a lost reply is recognised as the same call (as is
//	   the owner's Complete of the same response)
//	w  set once someone waits, so that Complete and Release publish a
//	   wake-up only when it can matter (PUBLISH is broadcast to every node
//	   of a Redis Cluster)
//	t  the tool's name, pd the claiming pod, at the claim's time in Unix
//	   milliseconds: what kubectl idemcp keys lists (see inspect.go)
//	a  set once MinReplicas replicas acknowledged the stored result (a
//	   WAIT after the Complete, or after a replay's confirmation, returned
//	   enough): a failover to one of them keeps it. Without it a replay
//	   first confirms the result (see reserveScript)
//
// Every script touches exactly one key, KEYS[1], so each runs on the node
// owning that key's slot and the layout works unchanged on Redis Cluster.
// Durations arrive as integer millisecond strings and are passed through to
// PEXPIRE as they are, because Redis formats Lua numbers as floats.
//
// Time is the server's (TIME), not the sidecars': sidecars with skewed
// clocks still agree on whether a lease has run out.

const nowMillis = `
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
`

// Reply codes of reserveScript.
const (
	codeWon       = 1
	codeCompleted = 2
	codePending   = 3
	codeAbandoned = 4
	codeTookOver  = 5
	// codeUnconfirmed: completed, but not yet acknowledged by MinReplicas
	// replicas. The script wrote to the record, so that a WAIT on its
	// connection covers the stored result.
	codeUnconfirmed = 6
)

// reserveScript: ARGV = fingerprint, owner, lease ms, keep ms (max of
// retention and lease), takeover ("1" or "0"), discard ("1" or "0"), the
// response to discard, confirm ("1": a completed record without a must be
// confirmed before it is replayed), tool, pod. Replies {code, fingerprint, response}
// or, for codeUnconfirmed, {code, fingerprint, response, nonce}.
var reserveScript = redis.NewScript(nowMillis + `
local rec = redis.call('HMGET', KEYS[1], 's', 'fp', 'o', 'l', 'r', 'a', 'n')
local now = now_ms()
-- A completed record the caller could not open is replaced, only if it is
-- still exactly the one the caller read.
if rec[1] == 'c' and ARGV[6] == '1' and (rec[5] or '') == ARGV[7] then
  redis.call('DEL', KEYS[1])
  rec = {false}
end
if not rec[1] then
  redis.call('HSET', KEYS[1], 's', 'p', 'fp', ARGV[1], 'o', ARGV[2],
    'l', string.format('%d', now + tonumber(ARGV[3])),
    't', ARGV[9] or '', 'pd', ARGV[10] or '', 'at', string.format('%d', now))
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {1}
end
local fp = rec[2] or ''
if rec[1] == 'c' then
  if ARGV[8] == '1' and not rec[6] then
    -- Replication is one ordered stream: once a replica acknowledges this
    -- write, it has the Complete before it too.
    redis.call('HINCRBY', KEYS[1], 'k', 1)
    return {6, fp, rec[5] or '', rec[7] or ''}
  end
  return {2, fp, rec[5] or ''}
end
-- Our own claim: this Reserve was re-sent after its reply was lost, maybe
-- much later (once Redis is back from a restart or a failover). The owner
-- runs the call with a whole lease ahead of it, so the lease starts again
-- now; otherwise another caller could take the claim over at once.
if rec[3] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'l', string.format('%d', now + tonumber(ARGV[3])))
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {1}
end
if (tonumber(rec[4]) or 0) > now then
  return {3, fp}
end
-- A claim of other arguments is never taken over: whoever reuses its
-- explicit key with them is told so.
if ARGV[5] ~= '1' or fp ~= ARGV[1] then
  return {4, fp}
end
redis.call('HSET', KEYS[1], 's', 'p', 'fp', ARGV[1], 'o', ARGV[2],
  'l', string.format('%d', now + tonumber(ARGV[3])),
  't', ARGV[9] or '', 'pd', ARGV[10] or '', 'at', string.format('%d', now))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {5, fp}
`)

// renewScript: ARGV = owner, lease ms. Replies 1, or 0 if not the owner.
// A record this owner completed is still its own: while its Complete is
// retried (say, on the new primary after a failover, where the claim is
// still pending), renewing must go on, not stop as if the claim were lost.
var renewScript = redis.NewScript(nowMillis + `
local rec = redis.call('HMGET', KEYS[1], 's', 'o')
if rec[1] == 'c' and rec[2] == ARGV[1] then
  return 1
end
if rec[1] ~= 'p' or rec[2] ~= ARGV[1] then
  return 0
end
local lease = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'l', string.format('%d', now_ms() + lease))
if redis.call('PTTL', KEYS[1]) < lease then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
`)

// completeScript: ARGV = owner, response, ttl ms, nonce, wake channel.
// Replies 1, or 0 if not the owner. The owner's Complete of the same
// response again (the engine retrying one whose replicas fell short) is
// the same Complete: it replies 1 and writes the nonce again, so that a
// WAIT after it covers the stored result.
var completeScript = redis.NewScript(`
local rec = redis.call('HMGET', KEYS[1], 's', 'o', 'n')
if rec[1] == 'c' and rec[2] == ARGV[1] then
  if rec[3] == ARGV[4] or redis.call('HGET', KEYS[1], 'r') == ARGV[2] then
    redis.call('HSET', KEYS[1], 'n', ARGV[4])
    return 1
  end
end
if rec[1] ~= 'p' or rec[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 's', 'c', 'r', ARGV[2], 'n', ARGV[4])
redis.call('HDEL', KEYS[1], 'l')
local waited = redis.call('HEXISTS', KEYS[1], 'w') == 1
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if waited then
  redis.call('PUBLISH', ARGV[5], KEYS[1])
end
return 1
`)

// ackScript: ARGV = nonce. Marks the completed record as acknowledged by
// MinReplicas replicas, if it still holds the result of the Complete (or
// confirmation) whose WAIT said so. Replies 1, or 0 if the record changed.
// It needs no WAIT of its own: a failover that loses the mark keeps the
// record unacknowledged, and its next replay confirms it again.
var ackScript = redis.NewScript(`
local rec = redis.call('HMGET', KEYS[1], 's', 'n')
if rec[1] ~= 'c' or rec[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'a', '1')
return 1
`)

// releaseScript: ARGV = owner, wake channel. Replies 1, or 0 if not the
// owner.
var releaseScript = redis.NewScript(`
local rec = redis.call('HMGET', KEYS[1], 's', 'o', 'w')
if rec[1] ~= 'p' or rec[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if rec[3] then
  redis.call('PUBLISH', ARGV[2], KEYS[1])
end
return 1
`)

// probeScript replies the milliseconds left on a pending claim's lease, or
// 0 if the key is not pending under a live lease, or -1 for a completed
// record still to be confirmed (ARGV[1] "1", as in reserveScript). A live
// claim is marked as waited on in the same step, so its Complete or
// Release cannot miss a waiter that saw it pending.
var probeScript = redis.NewScript(nowMillis + `
local rec = redis.call('HMGET', KEYS[1], 's', 'l', 'a')
if rec[1] == 'c' and ARGV[1] == '1' and not rec[3] then
  return -1
end
if rec[1] ~= 'p' then
  return 0
end
local left = (tonumber(rec[2]) or 0) - now_ms()
if left <= 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'w', '1')
return left
`)

// dropScript: ARGV = "c" (forget a result) or "p" (release a claim whose
// lease ran out), wake channel. Replies {code, state, lease ms, tool, pod,
// claimed ms, pttl ms}: code 1 dropped, 0 no record, -1 another state, -2
// a claim whose lease is live.
var dropScript = redis.NewScript(nowMillis + `
local rec = redis.call('HMGET', KEYS[1], 's', 'l', 't', 'pd', 'at', 'w')
if not rec[1] then
  return {0}
end
local info = {rec[1], rec[2] or '', rec[3] or '', rec[4] or '', rec[5] or '', redis.call('PTTL', KEYS[1])}
if rec[1] ~= ARGV[1] then
  return {-1, unpack(info)}
end
if rec[1] == 'p' and (tonumber(rec[2]) or 0) > now_ms() then
  return {-2, unpack(info)}
end
redis.call('DEL', KEYS[1])
if rec[6] then
  redis.call('PUBLISH', ARGV[2], KEYS[1])
end
return {1, unpack(info)}
`)

var allScripts = []*redis.Script{reserveScript, renewScript, completeScript, ackScript, releaseScript, probeScript, dropScript}
