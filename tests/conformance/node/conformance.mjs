// Conformance of a running roseinfer worker to its Redis wire protocol (version 3), from another language.
//
// Everything here is raw Redis commands, written from the protocol's description alone (docs/protocol.md): no
// Python producer library is involved, so whatever the Python client papers over shows up here.
//
//   REDIS_URL=redis://127.0.0.1:6379/0 ROSEINFER_QUEUE=roseinfer node conformance.mjs
//
// One line per scenario, PASS or FAIL with the reason; exit code 0 only when every scenario passed.

import { randomBytes } from 'node:crypto';
import { createClient } from 'redis';

const REDIS_URL = process.env.REDIS_URL ?? 'redis://127.0.0.1:6379/0';
const QUEUE = process.env.ROSEINFER_QUEUE ?? 'roseinfer';
const WAIT_MS = 60_000; // every wait is bounded: a broken worker makes a scenario fail, never the script hang
const PROTOCOL_VERSION = 3;
// Ids of this run only, so runs against a shared Redis never read each other's keys.
const PREFIX = `conf-${randomBytes(6).toString('hex')}`;

// ----- keys ------------------------------------------------------------------------------------------------
const jobKey = (id) => `rq:job:${id}`;
const queueKey = (queue) => `rq:queue:${queue}`;
const channelKey = (id) => `roseinfer:tokens:${id}`;
const streamKey = (id) => `roseinfer:stream:${id}`;
const resultKey = (id) => `rq:results:${id}`; // RQ's result stream: the result is stored once
const canceledKey = (queue) => `rq:canceled:${queue}`;

// ----- small helpers ---------------------------------------------------------------------------------------
class CheckFailed extends Error {}

function check(condition, message) {
  if (!condition) throw new CheckFailed(message);
}

const show = (value) => JSON.stringify(value);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// A promise that rejects after `ms`; the timer is cleared either way so it never keeps the process alive.
async function withTimeout(promise, what, ms = WAIT_MS) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new CheckFailed(`timed out after ${ms / 1000} s waiting for ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

// Polls `probe` until it returns something other than null/undefined/false.
async function until(what, probe, ms = WAIT_MS) {
  const deadline = Date.now() + ms;
  for (;;) {
    const value = await probe();
    if (value !== null && value !== undefined && value !== false) return value;
    if (Date.now() > deadline) throw new CheckFailed(`timed out after ${ms / 1000} s waiting for ${what}`);
    await sleep(50);
  }
}

// RQ's date format: UTC with microseconds (JavaScript dates stop at milliseconds).
const rqTime = () => new Date().toISOString().replace('Z', '000Z');

// ----- the protocol ----------------------------------------------------------------------------------------

// The one decoder: a pub/sub message and a stream entry's `event` field hold the same JSON.
function decodeEvent(json) {
  const event = JSON.parse(json);
  check(Number.isInteger(event.n), `event without an integer n: ${json}`);
  check(typeof event.text === 'string' && Array.isArray(event.token_ids), `malformed event: ${json}`);
  return event;
}

const isFinal = (event) => event.finish_reason != null;

// The protocol's cancel: only a job that has not ended, with its id in its queue's canceled set; 1 or 0.
const CANCEL = `local s = redis.call('HGET', KEYS[1], 'status')
if not s or s == 'finished' or s == 'failed' or s == 'canceled' or s == 'stopped' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'canceled')
local q = redis.call('HGET', KEYS[1], 'origin')
if q then redis.call('ZADD', 'rq:canceled:' .. q, ARGV[1], ARGV[2]) end
return 1`;

async function cancel(redis, id) {
  const expiry = Math.floor(Date.now() / 1000) + 86400;
  return redis.eval(CANCEL, { keys: [jobKey(id)], arguments: [String(expiry), id] });
}

// Writes the job's hash (status queued) without pushing it: a scenario may change it before the worker sees it.
async function writeJob(redis, id, payload, extra = {}) {
  const now = rqTime();
  await redis.hSet(jobKey(id), {
    data: JSON.stringify(['worker.jobs.generate', null, [], payload]),
    origin: QUEUE,
    status: 'queued',
    created_at: now,
    enqueued_at: now,
    description: `conformance ${id}`,
    ...extra,
  });
}

async function pushJob(redis, id) {
  await redis.sAdd('rq:queues', queueKey(QUEUE));
  await redis.rPush(queueKey(QUEUE), id);
}

async function enqueue(redis, id, payload) {
  await writeJob(redis, id, payload);
  await pushJob(redis, id);
}

// Replays the job's stream: every event written so far, decoded with the same function as the channel's.
async function replay(redis, id) {
  const entries = await redis.xRange(streamKey(id), '-', '+');
  return entries.map((entry) => decodeEvent(entry.message.event));
}

// A pub/sub follower as the protocol describes one: subscribe first, then replay the stream with XRANGE, and
// drop channel events whose n it already has (the two paths overlap around the moment of subscribing).
async function follow(sub, redis, id) {
  const events = new Map(); // n -> event
  let firstSeen, finalSeen, failed;
  const first = new Promise((resolve) => (firstSeen = resolve));
  const final = new Promise((resolve, reject) => {
    finalSeen = resolve;
    failed = reject;
  });
  final.catch(() => {}); // a scenario that stops early never awaits it: no unhandled rejection
  const accept = (event) => {
    if (events.has(event.n)) return;
    events.set(event.n, event);
    firstSeen(event);
    if (isFinal(event)) finalSeen(event);
  };
  await sub.subscribe(channelKey(id), (message) => {
    try {
      accept(decodeEvent(message));
    } catch (err) {
      failed(err); // surfaces in the scenario instead of crashing the client's event loop
    }
  });
  return {
    events,
    first,
    // Call once the job is (or may be) enqueued; events already streamed come in here, later ones on the channel.
    async catchUp() {
      for (const event of await replay(redis, id)) accept(event);
    },
    async final() {
      return withTimeout(final, `the final event of ${id}`);
    },
    ordered: () => [...events.values()].sort((a, b) => a.n - b.n),
    close: () => sub.unsubscribe(channelKey(id)),
  };
}

// The checks every complete event sequence must pass: n runs 0..k without gaps, exactly the last one is final.
function checkSequence(events) {
  check(events.length > 0, 'no events');
  const ns = events.map((e) => e.n);
  check(
    ns.every((n, i) => n === i),
    `n does not run 0..${events.length - 1} without gaps: ${show(ns)}`,
  );
  const finals = events.filter(isFinal).map((e) => e.n);
  check(finals.length === 1 && finals[0] === events.length - 1, `final events at n=${show(finals)}, not only the last`);
  return events.at(-1);
}

const joinText = (events) => events.map((e) => e.text).join('');
const joinIds = (events) => events.flatMap((e) => e.token_ids);

// The result: the latest entry of RQ's result stream holds it in `return_value`, JSON in base64 (null: none yet).
async function readResult(redis, id) {
  const [latest] = await redis.xRevRange(resultKey(id), '+', '-', { COUNT: 1 });
  const encoded = latest?.message?.return_value;
  return encoded === undefined ? null : JSON.parse(Buffer.from(encoded, 'base64').toString('utf8'));
}

// The ordering guarantee: once the final event is out, the result and the job's final status are there.
async function resultAfterFinal(redis, id) {
  const result = await readResult(redis, id);
  check(result !== null, `no result in ${resultKey(id)} right after the final event (it must be written before)`);
  check(!(await redis.exists(`roseinfer:result:${id}`)), 'a second copy of the result (protocol 2\'s key)');
  return result;
}

async function statusAfterFinal(redis, id, expected) {
  const status = await redis.hGet(jobKey(id), 'status');
  check(status === expected, `HGET ${jobKey(id)} status is ${show(status)} right after the final event, not ${expected}`);
}

// ----- scenarios -------------------------------------------------------------------------------------------
const state = {}; // what a later scenario reads of an earlier one (the TTLs of scenario 1's job)

async function chatFollowedLive({ redis, sub }) {
  const id = `${PREFIX}-chat`;
  state.chatId = id;
  const follower = await follow(sub, redis, id); // subscribed before the job exists: nothing can be missed
  try {
    await enqueue(redis, id, {
      messages: [{ role: 'user', content: 'Say hello to the conformance test.' }],
      max_tokens: 8,
      temperature: 0,
      custom_id: `${id}-custom`,
    });
    await follower.catchUp();
    const final = await follower.final();
    const result = await resultAfterFinal(redis, id);
    await statusAfterFinal(redis, id, 'finished');
    const events = follower.ordered();
    checkSequence(events);
    const versions = [...new Set([...events.map((e) => e.v), result.v])];
    check(versions.length === 1 && versions[0] === PROTOCOL_VERSION, `"v" of events and result: ${show(versions)}`);
    check(result.status === 'finished', `result status ${show(result.status)}`);
    check(result.id === id && result.custom_id === `${id}-custom`, `result id/custom_id: ${result.id}, ${result.custom_id}`);
    check(joinText(events) === result.text, `streamed text ${show(joinText(events))} != result ${show(result.text)}`);
    check(show(joinIds(events)) === show(result.token_ids), 'streamed token_ids differ from the result\'s');
    check(final.finish_reason === result.finish_reason, `finish_reason ${final.finish_reason} != ${result.finish_reason}`);
    check(final.usage && final.usage.completion_tokens === result.usage.completion_tokens,
      `final usage ${show(final.usage)} != result usage ${show(result.usage)}`);
    return `${events.length} events, ${result.usage.completion_tokens} tokens, finish_reason ${final.finish_reason}`;
  } finally {
    await follower.close();
  }
}

async function sampledFollowedLate({ redis }) {
  const id = `${PREFIX}-sampled`;
  await enqueue(redis, id, {
    prompt: 'Once upon a time',
    max_tokens: 8,
    temperature: 0.8,
    top_p: 0.9,
    seed: 7,
  });
  // Nobody follows: wait for the result, then for the final entry (written after the result) and replay.
  const result = await until(`the result in ${resultKey(id)}`, () => readResult(redis, id));
  const events = await until(`the final entry of ${streamKey(id)}`, async () => {
    const replayed = await replay(redis, id);
    return replayed.some(isFinal) && replayed;
  });
  const final = checkSequence(events);
  check(result.status === 'finished', `result status ${show(result.status)}`);
  check(joinText(events) === result.text, `replayed text ${show(joinText(events))} != result ${show(result.text)}`);
  check(final.usage?.completion_tokens === result.usage.completion_tokens, 'final usage differs from the result\'s');
  return `${events.length} entries replayed, ${result.usage.completion_tokens} tokens`;
}

async function cancelRunning({ redis, sub }) {
  const id = `${PREFIX}-cancel-running`;
  const follower = await follow(sub, redis, id);
  try {
    await enqueue(redis, id, { prompt: 'Write forever', max_tokens: 200, temperature: 0, ignore_eos: true });
    await follower.catchUp();
    const first = await withTimeout(follower.first, `the first event of ${id}`);
    check(!isFinal(first), `the job ended before it could be canceled: ${show(first)}`);
    check((await cancel(redis, id)) === 1, 'the cancel script did not cancel a running job');
    const final = await follower.final();
    const result = await resultAfterFinal(redis, id);
    await statusAfterFinal(redis, id, 'canceled');
    check((await redis.zScore(canceledKey(QUEUE), id)) !== null, `${id} is not in ${canceledKey(QUEUE)}`);
    const events = follower.ordered();
    checkSequence(events);
    check(final.finish_reason === 'abort', `final finish_reason ${show(final.finish_reason)}, not abort`);
    check(result.status === 'canceled', `result status ${show(result.status)}, not canceled`);
    check(joinText(events) === result.text, `streamed text ${show(joinText(events))} != result ${show(result.text)}`);
    const tokens = result.usage?.completion_tokens;
    check(Number.isInteger(tokens) && tokens < 200, `completion_tokens ${show(tokens)}: not stopped early`);
    return `stopped after ${tokens} of 200 tokens`;
  } finally {
    await follower.close();
  }
}

async function cancelQueued({ redis, sub }) {
  const id = `${PREFIX}-cancel-queued`;
  const follower = await follow(sub, redis, id);
  try {
    await writeJob(redis, id, { prompt: 'Never run me', max_tokens: 50, temperature: 0, ignore_eos: true });
    // Canceled before the id is even on the queue: surely canceled while queued, whatever the worker's speed.
    await redis.hSet(jobKey(id), 'status', 'canceled'); // a bare HSET: the other way the protocol names
    await pushJob(redis, id);
    await follower.catchUp();
    const final = await follower.final();
    const result = await resultAfterFinal(redis, id);
    const events = follower.ordered();
    checkSequence(events);
    check(final.finish_reason === 'abort', `final finish_reason ${show(final.finish_reason)}, not abort`);
    check(result.status === 'canceled', `result status ${show(result.status)}, not canceled`);
    const score = await redis.zScore(canceledKey(QUEUE), id);
    check(score !== null, `${id} is not in ${canceledKey(QUEUE)}`);
    const generated = (result.usage?.completion_tokens ?? 0) + (result.token_ids ?? []).length + joinIds(events).length;
    check(generated === 0, `tokens were generated for a job canceled while queued: ${show(result.usage)}`);
    return 'never ran, in the canceled set';
  } finally {
    await follower.close();
  }
}

async function failedJob({ redis, sub }) {
  const id = `${PREFIX}-failed`;
  const follower = await follow(sub, redis, id);
  try {
    await enqueue(redis, id, { prompt: 'hi', max_tokens: 4, colour: 'red' }); // unknown fields fail the job
    await follower.catchUp();
    const final = await follower.final();
    const result = await resultAfterFinal(redis, id);
    await statusAfterFinal(redis, id, 'failed');
    checkSequence(follower.ordered());
    check(final.finish_reason === 'error', `final finish_reason ${show(final.finish_reason)}, not error`);
    check(typeof final.error === 'string' && final.error.includes('colour'), `event error ${show(final.error)}`);
    check(result.status === 'failed', `result status ${show(result.status)}, not failed`);
    check(result.finish_reason === 'error', `result finish_reason ${show(result.finish_reason)}`);
    check(result.error === final.error, `result error ${show(result.error)} != event error ${show(final.error)}`);
    return `error: ${final.error}`;
  } finally {
    await follower.close();
  }
}

async function ttls({ redis }) {
  const id = state.chatId;
  check(id, 'scenario 1 did not submit its job');
  const [jobTtl, resultTtl] = await Promise.all([redis.ttl(jobKey(id)), redis.ttl(resultKey(id))]);
  // TTL answers -2 for a missing key and -1 for one that never expires.
  check(jobTtl > 0, `TTL ${jobKey(id)} is ${jobTtl}`);
  check(resultTtl > 0, `TTL ${resultKey(id)} is ${resultTtl}`);
  check(Math.abs(jobTtl - resultTtl) <= 120, `job hash TTL ${jobTtl} s and result TTL ${resultTtl} s differ by > 120 s`);
  return `job hash ${jobTtl} s, result ${resultTtl} s`;
}

async function cancelEnded({ redis }) {
  const id = state.chatId;
  check(id, 'scenario 1 did not submit its job');
  check((await cancel(redis, id)) === 0, `the cancel script canceled ${id}, which had finished`);
  const status = await redis.hGet(jobKey(id), 'status');
  check(status === 'finished', `a finished job's status is ${show(status)} after a cancel`);
  const missing = `${PREFIX}-never-submitted`;
  check((await cancel(redis, missing)) === 0, 'the cancel script canceled a job that does not exist');
  check((await redis.exists(jobKey(missing))) === 0, `a cancel of a missing job wrote ${jobKey(missing)}`);
  return 'a finished job and a missing one left as they were';
}

const SCENARIOS = [
  ['chat job followed live', chatFollowedLive],
  ['sampled prompt job followed late', sampledFollowedLate],
  ['cancel a running job', cancelRunning],
  ['cancel a queued job', cancelQueued],
  ['failed job (unknown field)', failedJob],
  ['TTLs of job hash and result', ttls],
  ['cancel of an ended or missing job', cancelEnded],
];

// ----- main ------------------------------------------------------------------------------------------------
function connect(client, name) {
  // node-redis emits 'error' on every socket failure; unhandled, that would kill the process mid-scenario.
  client.on('error', (err) => console.error(`redis (${name}): ${err.message}`));
  return client.connect();
}

async function main() {
  // A few reconnect attempts, then give up: an unreachable Redis must not make the script wait forever.
  const redis = createClient({
    url: REDIS_URL,
    socket: { connectTimeout: 5000, reconnectStrategy: (tries) => (tries < 5 ? 200 : new Error('giving up')) },
  });
  await connect(redis, 'commands');
  const sub = redis.duplicate(); // a subscribed connection runs no other commands
  await connect(sub, 'pub/sub');
  console.log(`# queue ${QUEUE}, job ids ${PREFIX}-*`);
  let failures = 0;
  try {
    for (const [i, [name, scenario]] of SCENARIOS.entries()) {
      try {
        const detail = await scenario({ redis, sub });
        console.log(`PASS ${i + 1} ${name}: ${detail}`);
      } catch (err) {
        failures += 1;
        const reason = err instanceof CheckFailed ? err.message : err.stack;
        console.log(`FAIL ${i + 1} ${name}: ${reason}`);
      }
    }
  } finally {
    await Promise.allSettled([sub.quit(), redis.quit()]);
  }
  console.log(`# ${SCENARIOS.length - failures} of ${SCENARIOS.length} scenarios passed`);
  return failures === 0 ? 0 : 1;
}

main().then(
  (code) => {
    process.exitCode = code;
  },
  (err) => {
    console.error(err);
    process.exitCode = 2;
  },
);
