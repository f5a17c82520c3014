(() => {
  'use strict';

  const POLL_MS = 1000;
  const FETCH_TIMEOUT_MS = 5000;
  const HISTORY = 120;
  const MAX_EVENTS = 200;
  const SSE_RETRY_MS = 5000;
  // The room (job) this page shows: ?job=NAME in the page's address (empty: the default room).
  const JOB = new URLSearchParams(window.location.search).get('job') || '';
  const JOB_QUERY = JOB ? '?job=' + encodeURIComponent(JOB) : '';
  const STATES = ['joining', 'healing', 'healthy', 'straggler', 'lost', 'failed', 'finished'];
  const INACTIVE = ['lost', 'failed', 'finished'];
  const EVENT_KINDS = {
    lighthouse_started: 'info',
    quorum_changed: 'info',
    replica_joined: 'good',
    state_changed: 'info',
    replica_lost: 'bad',
    replica_healed: 'good',
    commit_failed: 'bad',
    straggler_flagged: 'warn',
    straggler_cleared: 'good',
    straggler_dropped: 'warn',
    replica_failed: 'bad',
    replica_finished: 'info',
    kill_requested: 'info',
    progress_regressed: 'bad',
    replica_hung: 'bad',
    replica_resumed: 'good',
    replica_diverged: 'bad',
    snapshot_complete: 'good',
    snapshot_failed: 'bad',
  };

  const $ = (id) => document.getElementById(id);

  // ---------- small helpers (all server data goes through textContent / setAttribute) ----------

  function setText(node, value) {
    const text = String(value);
    if (node.textContent !== text) node.textContent = text;
  }

  function setAttr(node, name, value) {
    if (value === null || value === undefined) {
      if (node.hasAttribute(name)) node.removeAttribute(name);
    } else {
      const text = String(value);
      if (node.getAttribute(name) !== text) node.setAttribute(name, text);
    }
  }

  function setClass(node, cls) {
    if (node.className !== cls) node.className = cls;
  }

  const isNum = (v) => typeof v === 'number' && Number.isFinite(v);
  const DASH = '–';

  function fmtFixed(v, digits) {
    return isNum(v) ? v.toFixed(digits) : DASH;
  }

  function fmtInt(v) {
    return isNum(v) ? String(Math.round(v)) : DASH;
  }

  function fmtMs(seconds) {
    if (!isNum(seconds)) return DASH;
    const ms = seconds * 1000;
    if (Math.abs(ms) >= 100) return ms.toFixed(0);
    if (Math.abs(ms) >= 10) return ms.toFixed(1);
    return ms.toFixed(2);
  }

  function fmtRate(v) {
    if (!isNum(v)) return DASH;
    if (v >= 100) return v.toFixed(0);
    if (v >= 10) return v.toFixed(1);
    return v.toFixed(2);
  }

  function fmtDuration(s) {
    if (!isNum(s) || s < 0) return DASH;
    s = Math.floor(s);
    const d = Math.floor(s / 86400);
    const h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60);
    const sec = s % 60;
    const p2 = (n) => String(n).padStart(2, '0');
    if (d > 0) return `${d}d ${p2(h)}h`;
    if (h > 0) return `${h}h ${p2(m)}m`;
    if (m > 0) return `${m}m ${p2(sec)}s`;
    return `${sec}s`;
  }

  function fmtBytes(n) {
    if (!isNum(n) || n < 0) return DASH;
    if (n < 1024) return `${Math.round(n)} B`;
    let v = n;
    for (const unit of ['KiB', 'MiB', 'GiB', 'TiB', 'PiB']) {
      v /= 1024;
      if (v < 1024 || unit === 'PiB') return `${v.toFixed(v < 10 ? 2 : 1)} ${unit}`;
    }
    return DASH;
  }

  const fmtPct = (ratio) => (isNum(ratio) ? (ratio * 100).toFixed(1) + '%' : DASH);
  const GOODPUT_KEYS = ['wall_s', 'productive_s', 'quorum_s', 'discarded_s', 'heal_s', 'recovery_s', 'regressed_s'];

  // A goodput account (productive / wall time and where the rest went), one line per field.
  function goodputTitle(g, what) {
    if (!g || typeof g !== 'object') return `${what}: no committed step yet`;
    return [`${what}: ${fmtPct(g.ratio)} productive / wall time`]
      .concat(GOODPUT_KEYS.map((k) => `${k.replace(/_s$/, '')}: ${fmtFixed(g[k], 1)} s`))
      .concat([`regressed steps: ${fmtValue(g.regressed_steps)}`, `steps committed: ${fmtValue(g.steps_committed)}`,
        `step: ${fmtValue(g.step)}`]).join('\n');
  }

  function truncate(s, n) {
    s = String(s);
    return s.length > n ? s.slice(0, n - 1) + '…' : s;
  }

  function clockTime(ts) {
    if (!isNum(ts)) return '--:--:--';
    const d = new Date(ts * 1000);
    const p2 = (n) => String(n).padStart(2, '0');
    return `${p2(d.getHours())}:${p2(d.getMinutes())}:${p2(d.getSeconds())}`;
  }

  function fmtValue(v) {
    if (v === null || v === undefined) return DASH;
    if (typeof v === 'number') {
      if (!Number.isFinite(v)) return String(v);
      if (Number.isInteger(v)) return String(v);
      return String(Number(v.toPrecision(4)));
    }
    if (Array.isArray(v)) return '[' + v.map(fmtValue).join(', ') + ']';
    if (typeof v === 'object') {
      try { return JSON.stringify(v); } catch (_) { return '{…}'; }
    }
    return String(v);
  }

  // ---------- header ----------

  let lastStatus = null;
  let lastOkAt = null;

  function renderHeader(status, replicas) {
    setText($('quorum-id'), status.quorum_id === null || status.quorum_id === undefined ? 'none' : fmtValue(status.quorum_id));
    setText($('min-replicas'), fmtValue(status.min_replicas));
    const members = Array.isArray(status.members) ? status.members : [];
    setText($('members-count'), members.length);
    setText($('replica-count'), replicas.length);

    const counts = new Map();
    for (const r of replicas) {
      const st = typeof r.state === 'string' ? r.state : 'unknown';
      counts.set(st, (counts.get(st) || 0) + 1);
    }
    const order = STATES.filter((s) => counts.has(s)).concat([...counts.keys()].filter((s) => !STATES.includes(s)).sort());
    setText($('state-summary'), order.length ? '(' + order.map((s) => `${counts.get(s)} ${s}`).join(', ') + ')' : '');

    const ready = $('ready');
    if (status.ready === true) {
      setText(ready, 'ready');
      setClass(ready, 'value yes');
    } else if (status.ready === false) {
      setText(ready, 'not ready');
      setClass(ready, 'value no');
    } else {
      setText(ready, DASH);
      setClass(ready, 'value');
    }
    const reason = typeof status.reason === 'string' ? status.reason : '';
    setText($('reason'), reason ? '· ' + truncate(reason, 140) : '');
    setAttr($('reason'), 'title', reason || null);

    if (isNum(status.started_unix_s)) {
      setText($('uptime'), fmtDuration(Date.now() / 1000 - status.started_unix_s));
      setAttr($('uptime'), 'title', 'started ' + new Date(status.started_unix_s * 1000).toLocaleString());
    } else {
      setText($('uptime'), DASH);
    }

    const g = status.goodput && typeof status.goodput === 'object' ? status.goodput : null;
    setText($('goodput'), fmtPct(g ? g.ratio : null));
    setAttr($('goodput-field'), 'title', goodputTitle(g, 'job goodput') +
      (g && isNum(g.window_start_unix_s) ? '\nsince ' + new Date(g.window_start_unix_s * 1000).toLocaleString() : ''));

    renderSnapshot(status);
    renderRooms(status);

    const allowKill = status.allow_kill === true;
    $('kill-hint').hidden = allowKill;

    const q = isNum(status.quorum_id) ? ` · quorum ${status.quorum_id}` : '';
    const title = `torchft lighthouse${q} · ${replicas.length} replica${replicas.length === 1 ? '' : 's'}`;
    if (document.title !== title) document.title = title;
  }

  // The latest complete durable snapshot: step, age, writer group, size, and failed attempts.
  function renderSnapshot(status) {
    const s = status.snapshot && typeof status.snapshot === 'object' ? status.snapshot : null;
    const counters = status.counters && typeof status.counters === 'object' ? status.counters : {};
    if (s) {
      setText($('snapshot-step'), fmtInt(s.step));
      const who = s.replica_id === undefined || s.replica_id === null ? '?' : String(s.replica_id);
      setText($('snapshot-detail'), `${fmtDuration(s.age_s)} ago · ${truncate(who, 40)} · ${fmtBytes(s.bytes)}`);
      setAttr($('snapshot-field'), 'title', [
        `latest complete durable snapshot: step ${fmtInt(s.step)}`,
        `written by ${who} (quorum ${fmtValue(s.quorum_id)})`,
        `path: ${fmtValue(s.path)}`,
        `${fmtValue(s.bytes)} bytes; staged in ${fmtFixed(s.stage_s, 3)} s, written in ${fmtFixed(s.write_s, 1)} s`,
        isNum(s.unix_s) ? 'completed ' + new Date(s.unix_s * 1000).toLocaleString() : '',
      ].filter(Boolean).join('\n'));
    } else {
      setText($('snapshot-step'), 'none');
      setText($('snapshot-detail'), '');
      setAttr($('snapshot-field'), 'title', 'no complete durable snapshot yet');
    }
    const failed = isNum(counters.snapshot_failures) ? counters.snapshot_failures : 0;
    const failures = $('snapshot-failures');
    setText(failures, failed > 0 ? `· ${failed} failed` : '');
    setClass(failures, failed > 0 ? 'bad' : '');
  }

  function setConnection(ok, err) {
    const conn = $('conn');
    if (ok) {
      lastOkAt = Date.now();
      conn.hidden = true;
    } else {
      const why = err && err.message ? err.message : 'request failed';
      setText(conn, `connection lost (${why}) – retrying`);
      conn.hidden = false;
    }
    updateAge();
  }

  function updateAge() {
    const el = $('updated');
    if (lastOkAt === null) {
      setText(el, 'waiting for /status…');
      return;
    }
    const age = (Date.now() - lastOkAt) / 1000;
    setText(el, age < 2 ? 'live' : `last update ${fmtDuration(age)} ago`);
  }

  // ---------- replica table ----------

  const tbody = $('replicas-body');
  const rows = new Map(); // replica_id -> row record
  const COLUMNS = [
    ['id', 'replica-id'],
    ['state', 'state'],
    ['verdict', 'verdict'],
    ['step', 'step'],
    ['hb', 'hb-age'],
    ['rate', 'rate'],
    ['busy', 'busy'],
    ['stepTime', 'step-time'],
    ['skew', 'skew'],
    ['parts', 'participants'],
    ['heals', 'heals'],
    ['goodput', 'goodput'],
    ['error', 'last-error'],
    ['actions', 'actions'],
  ];

  function makeRow(id) {
    const tr = document.createElement('tr');
    tr.className = 'replica';
    tr.setAttribute('data-replica-id', id);
    const cells = {};
    for (const [key, cls] of COLUMNS) {
      const td = document.createElement('td');
      td.className = cls;
      tr.appendChild(td);
      cells[key] = td;
    }
    const badge = document.createElement('span');
    badge.className = 'badge s-unknown';
    cells.state.appendChild(badge);
    const btn = document.createElement('button');
    btn.type = 'button';
    btn.className = 'kill';
    btn.textContent = 'Kill';
    btn.hidden = true;
    btn.disabled = true;
    btn.addEventListener('click', () => killReplica(id, btn));
    cells.actions.appendChild(btn);
    return { tr, cells, badge, btn };
  }

  function replicaTooltip(r) {
    const lines = [String(r.replica_id)];
    if (r.incarnation !== undefined && r.incarnation !== null) lines.push('incarnation: ' + r.incarnation);
    if (r.hostname) lines.push('host: ' + r.hostname);
    if (Array.isArray(r.pids) && r.pids.length) lines.push('pids: ' + r.pids.join(', '));
    if (r.ranks_reporting !== undefined || r.world_size !== undefined) {
      lines.push(`ranks reporting: ${fmtValue(r.ranks_reporting)} / ${fmtValue(r.world_size)}`);
    }
    if (typeof r.in_quorum === 'boolean') lines.push('in quorum: ' + (r.in_quorum ? 'yes' : 'no'));
    if (isNum(r.last_report_age_s)) lines.push('last report: ' + r.last_report_age_s.toFixed(1) + ' s ago');
    const c = r.counters && typeof r.counters === 'object' ? r.counters : null;
    if (c) {
      lines.push(`steps committed: ${fmtValue(c.steps_committed)}, incarnations: ${fmtValue(c.incarnations)}, lost: ${fmtValue(c.lost)}`);
      lines.push(`reports: ${fmtValue(c.reports)}, dropped: ${fmtValue(c.reports_dropped)}, heal bytes: ${fmtValue(c.heal_bytes)}`);
    }
    return lines.join('\n');
  }

  // Why a straggler was named its cause: its step phases (window medians).
  function stragglerWhy(r) {
    const t = r.timings && typeof r.timings === 'object' ? r.timings : {};
    const parts = ['input_s', 'forward_s', 'backward_s', 'optimizer_s', 'collective_s']
      .map((k) => `${k.replace(/_s$/, '')} ${fmtMs(t[k])} ms`);
    return `straggler, ${r.straggler_cause}: ${parts.join(', ')}; host load ${fmtFixed(t.host_load, 2)}`;
  }

  // The lighthouse's verdicts on replica group processes (ids `name:uuid`, as `incarnation`).
  function verdicts(status) {
    const out = new Map();
    const add = (id, text, why) => {
      if (typeof id === 'string' && !out.has(id)) out.set(id, { text, why });
    };
    const parity = status.parity && typeof status.parity === 'object' ? status.parity : {};
    for (const id of Array.isArray(parity.stopped) ? parity.stopped : []) {
      add(id, 'stopped', 'its committed state differs from the others\' with no majority: it stops');
    }
    for (const id of Array.isArray(parity.healing) ? parity.healing : []) {
      add(id, 'diverged', 'its committed state differed from the majority\'s: it heals from them');
    }
    for (const d of Array.isArray(status.dropped) ? status.dropped : []) {
      if (d && typeof d === 'object') {
        add(d.replica_id, 'dropped', `${d.reason}: dropped from the quorum, rejoins in ` +
          `${fmtFixed(d.remaining_s, 1)} s`);
      }
    }
    for (const h of Array.isArray(status.hung) ? status.hung : []) {
      if (h && typeof h === 'object') {
        add(h.replica_id, 'hung', `training loop away ${fmtFixed(h.idle_s, 1)} s ` +
          `(hang timeout ${fmtFixed(h.hang_timeout_s, 1)} s): not waited for`);
      }
    }
    return out;
  }

  function updateRow(row, r, allowKill, hbTimeout, verdict) {
    const state = typeof r.state === 'string' && r.state ? r.state : 'unknown';
    const straggler = state === 'straggler' || r.straggler === true;
    let cls = 'replica';
    if (straggler) cls += ' straggler';
    if (INACTIVE.includes(state)) cls += ' inactive';
    setClass(row.tr, cls);
    setAttr(row.tr, 'data-state', state);

    const c = row.cells;
    setText(c.id, r.replica_id);
    setAttr(c.id, 'title', replicaTooltip(r));

    setText(row.badge, state);
    setClass(row.badge, 'badge ' + (STATES.includes(state) ? 's-' + state : 's-unknown'));
    setAttr(row.badge, 'title', isNum(r.state_since_s) ? `${state} for ${fmtDuration(r.state_since_s)}` : state);

    setText(c.verdict, verdict ? verdict.text : '');
    setAttr(c.verdict, 'title', verdict ? verdict.why : null);

    setText(c.step, fmtInt(r.step));

    const hb = r.last_heartbeat_age_s;
    setText(c.hb, fmtFixed(hb, 1));
    setClass(c.hb, 'hb-age' + (isNum(hb) && isNum(hbTimeout) && hb > hbTimeout / 2 ? ' stale' : ''));

    setText(c.rate, fmtRate(r.steps_per_s));
    const t = r.timings && typeof r.timings === 'object' ? r.timings : {};
    setText(c.busy, fmtMs(t.busy_s));
    setText(c.stepTime, fmtMs(t.step_s));
    const timingTitle = ['step_s', 'busy_s', 'input_s', 'forward_s', 'backward_s', 'optimizer_s',
      'quorum_wait_s', 'collective_s', 'should_commit_s', 'heal_s', 'cpu_s']
      .map((k) => `${k.replace(/_s$/, '')}: ${fmtMs(t[k])} ms`).join('\n');
    setAttr(c.busy, 'title', timingTitle);
    setAttr(c.stepTime, 'title', timingTitle);

    const skew = r.skew_pct;
    setText(c.skew, isNum(skew) ? (skew > 0 ? '+' : '') + skew.toFixed(1) + '%' : DASH);
    setClass(c.skew, 'skew' + (straggler ? ' high' : ''));

    setText(c.parts, fmtValue(r.participants));
    const counters = r.counters && typeof r.counters === 'object' ? r.counters : {};
    setText(c.heals, `${fmtValue(counters.heals)} / ${fmtValue(counters.commit_failures)}`);
    const h = r.last_heal && typeof r.last_heal === 'object' ? r.last_heal : null;
    setAttr(c.heals, 'title', h
      ? `last heal: from ${h.source || '?'}${h.addr ? ' at ' + h.addr : ''} to step ${fmtInt(h.step)}, ${fmtValue(h.bytes)} bytes in ` +
        `${fmtFixed(h.seconds, 3)} s (${isNum(h.gbps) ? h.gbps.toFixed(3) : DASH} GB/s)`
      : 'heals / commit failures');

    setText(c.goodput, fmtPct(r.goodput_ratio));
    setAttr(c.goodput, 'title', goodputTitle(r.goodput, 'goodput of ' + r.replica_id));

    const err = r.last_error;
    if (err === null || err === undefined || err === '') {
      setText(c.error, '');
      setAttr(c.error, 'title', null);
    } else {
      setText(c.error, truncate(String(err).replace(/\s+/g, ' '), 60));
      setAttr(c.error, 'title', String(err));
    }

    row.btn.hidden = !allowKill;
    if (!row.btn.classList.contains('busy')) row.btn.disabled = !allowKill;
    setAttr(row.btn, 'title', allowKill ? `end the manager process of ${r.replica_id}` : 'start the lighthouse with --allow_kill');
  }

  function renderReplicas(status, replicas) {
    const allowKill = status.allow_kill === true;
    const byProcess = verdicts(status);
    const seen = new Set();
    for (const r of replicas) {
      const id = String(r.replica_id);
      if (seen.has(id)) continue;
      seen.add(id);
      let row = rows.get(id);
      if (!row) {
        row = makeRow(id);
        rows.set(id, row);
      }
      let verdict = byProcess.get(String(r.incarnation)) || byProcess.get(id) || null;
      if (!verdict && typeof r.straggler_cause === 'string' && r.straggler_cause) {
        verdict = { text: r.straggler_cause, why: stragglerWhy(r) };
      }
      updateRow(row, r, allowKill, status.heartbeat_timeout_s, verdict);
    }
    for (const [id, row] of rows) {
      if (!seen.has(id)) {
        row.tr.remove();
        rows.delete(id);
      }
    }
    // Keep rows ordered by replica_id (code-unit order, like the server), moving only what is out of place.
    const ids = [...rows.keys()].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    let prev = null;
    for (const id of ids) {
      const tr = rows.get(id).tr;
      const expected = prev ? prev.nextSibling : tbody.firstChild;
      if (tr !== expected) tbody.insertBefore(tr, expected);
      prev = tr;
    }
    $('no-replicas').hidden = rows.size > 0;
  }

  // ---------- room picker ----------
  // Shown once a second room is open; picking a room reloads the page on ?job=NAME.
  function renderRooms(status) {
    const picker = $('room');
    const rooms = Array.isArray(status.rooms) ? status.rooms : [];
    const jobs = rooms.map((r) => (r && typeof r.job === 'string' ? r.job : '')).filter((j, i, a) => a.indexOf(j) === i);
    if (JOB && !jobs.includes(JOB)) jobs.push(JOB);
    $('room-field').hidden = jobs.length < 2;
    const have = Array.from(picker.options).map((o) => o.value).join('\n');
    if (have !== jobs.join('\n')) {
      picker.textContent = '';
      for (const job of jobs) {
        const opt = document.createElement('option');
        opt.value = job;
        opt.textContent = job || '(default)';
        picker.appendChild(opt);
      }
    }
    picker.value = JOB;
  }

  $('room').addEventListener('change', (e) => {
    const job = e.target.value;
    window.location.search = job ? '?job=' + encodeURIComponent(job) : '';
  });

  // ---------- kill action ----------

  function setAction(text, kind) {
    const el = $('action-status');
    setText(el, text);
    setClass(el, kind || '');
  }

  async function killReplica(id, btn) {
    if (!lastStatus || lastStatus.allow_kill !== true) return;
    if (!window.confirm(`Kill replica group "${id}"?\n\nThis ends the group's manager process.`)) return;
    btn.disabled = true;
    btn.classList.add('busy');
    setAction(`kill ${id}: sending…`, 'pending');
    try {
      const url = 'replicas/' + encodeURIComponent(id) + '/kill' + JOB_QUERY;
      const post = () => {
        // The token goes as a Bearer header, never as cached Basic credentials: the server
        // accepts Basic for reading only, so another site's page cannot replay a login.
        const headers = {};
        const token = sessionStorage.getItem('torchft-token');
        if (token) headers['Authorization'] = 'Bearer ' + token;
        return fetch(url, { method: 'POST', cache: 'no-store', headers });
      };
      let resp = await post();
      if (resp.status === 401) {
        const token = window.prompt(`The lighthouse requires the job's token to kill "${id}".\n\nToken:`);
        if (token) {
          sessionStorage.setItem('torchft-token', token.trim());
          resp = await post();
          if (resp.status === 401) sessionStorage.removeItem('torchft-token');
        }
      }
      const body = await resp.text();
      let ok = resp.ok;
      let message = body.trim();
      try {
        const parsed = JSON.parse(body);
        if (parsed && typeof parsed === 'object') {
          if (typeof parsed.ok === 'boolean') ok = ok && parsed.ok;
          if (parsed.message !== undefined && parsed.message !== null) message = String(parsed.message);
        }
      } catch (_) {
        // not JSON: show the body as it is
      }
      const head = ok ? 'ok' : `failed (HTTP ${resp.status})`;
      setAction(`kill ${id}: ${head}${message ? ' – ' + truncate(message, 500) : ''}`, ok ? 'ok' : 'error');
    } catch (e) {
      setAction(`kill ${id}: request failed (${e && e.message ? e.message : e})`, 'error');
    } finally {
      btn.classList.remove('busy');
      btn.disabled = !(lastStatus && lastStatus.allow_kill === true);
    }
  }

  // ---------- charts ----------

  // One entry per point: t (unix seconds), step rate, quorum participants, goodput (%).
  const series = { t: [], rate: [], parts: [], goodput: [] };
  const SERIES = ['t', 'rate', 'parts', 'goodput'];
  let prevStep = null; // { step, t }
  let historyGen = 0; // bumped per history load: a late answer for an earlier one is dropped

  function trimSeries() {
    const extra = series.t.length - HISTORY;
    if (extra > 0) for (const k of SERIES) series[k].splice(0, extra);
  }

  function pushPoint(t, rate, parts, goodput) {
    series.t.push(t);
    series.rate.push(rate);
    series.parts.push(parts);
    series.goodput.push(goodput);
    trimSeries();
  }

  function stepRate(step, t) {
    let rate = null;
    if (isNum(step) && prevStep !== null) {
      const dt = t - prevStep.t;
      if (dt > 0) rate = Math.max(0, step - prevStep.step) / dt;
    }
    prevStep = isNum(step) ? { step, t } : null;
    return rate;
  }

  function recordPoint(status, replicas) {
    let maxStep = null;
    for (const r of replicas) {
      if (isNum(r.step)) maxStep = maxStep === null ? r.step : Math.max(maxStep, r.step);
    }
    const t = Date.now() / 1000;
    const members = Array.isArray(status.members) ? status.members.length : 0;
    const g = status.goodput && typeof status.goodput === 'object' ? status.goodput : null;
    pushPoint(t, stepRate(maxStep, t), members, g && isNum(g.ratio) ? g.ratio * 100 : null);
  }

  // Seeds the charts with the job's history (GET /history): the live points collected meanwhile
  // follow it. A failed or malformed answer leaves the live points alone.
  async function loadHistory() {
    const gen = ++historyGen;
    let body;
    try {
      body = await fetchJson('history');
    } catch (_) {
      return;
    }
    const points = Array.isArray(body.points) ? body.points.filter((p) => p && typeof p === 'object' && isNum(p.t)) : [];
    if (gen !== historyGen || !points.length) return;
    const live = series.t.map((t, i) => SERIES.map((k) => series[k][i]));
    const lastT = points[points.length - 1].t;
    for (const k of SERIES) series[k].length = 0;
    const livePrev = prevStep;
    prevStep = null;
    for (const p of points) {
      const step = isNum(p.step) ? p.step : null;
      pushPoint(p.t, stepRate(step, p.t), isNum(p.members) ? p.members : null, isNum(p.ratio) ? p.ratio * 100 : null);
    }
    for (const point of live) if (point[0] > lastT) pushPoint(...point);
    if (livePrev !== null && livePrev.t > lastT) prevStep = livePrev;
    renderCharts();
  }

  function seriesStats(data) {
    let max = null;
    let min = null;
    let current = null;
    for (const v of data) {
      if (v === null) continue;
      max = max === null ? v : Math.max(max, v);
      min = min === null ? v : Math.min(min, v);
    }
    for (let i = data.length - 1; i >= 0; i--) {
      if (data[i] !== null) { current = data[i]; break; }
    }
    return { max, min, current };
  }

  function niceTop(v, integer) {
    if (!(v > 0)) return 1;
    if (integer) return Math.max(1, Math.ceil(v * 1.15));
    const exp = Math.pow(10, Math.floor(Math.log10(v * 1.15)));
    const m = (v * 1.15) / exp;
    const nice = m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10;
    return nice * exp;
  }

  function drawChart(canvas, data, opts) {
    const cssW = Math.max(50, canvas.clientWidth);
    const cssH = Math.max(40, canvas.clientHeight);
    const dpr = window.devicePixelRatio || 1;
    const W = Math.round(cssW * dpr);
    const H = Math.round(cssH * dpr);
    if (canvas.width !== W) canvas.width = W;
    if (canvas.height !== H) canvas.height = H;
    const ctx = canvas.getContext('2d');
    if (!ctx) return;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);

    const left = 38, right = 8, top = 8, bottom = 16;
    const w = cssW - left - right;
    const h = cssH - top - bottom;
    const stats = seriesStats(data);
    const { max, current } = stats;
    const yTop = opts.top || niceTop(max === null ? 0 : max, opts.integer);
    // x by time: the window spans the points (at least HISTORY seconds), the latest at the right edge
    const times = series.t;
    const tEnd = times.length ? times[times.length - 1] : 0;
    const span = Math.max(HISTORY, times.length ? tEnd - times[0] : 0);
    const x = (i) => left + w - ((tEnd - times[i]) / span) * w;
    canvas.setAttribute('data-points', String(data.filter((v) => v !== null).length));
    const y = (v) => top + h - (v / yTop) * h;

    ctx.font = '10px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    ctx.lineWidth = 1;

    // axes and grid
    ctx.strokeStyle = '#eaeef2';
    ctx.beginPath();
    for (const f of [0, 0.5, 1]) {
      const gy = Math.round(top + h - f * h) + 0.5;
      ctx.moveTo(left, gy);
      ctx.lineTo(left + w, gy);
    }
    ctx.stroke();
    ctx.fillStyle = '#656d76';
    ctx.textAlign = 'right';
    ctx.fillText(opts.fmt(yTop), left - 4, top);
    ctx.fillText('0', left - 4, top + h);
    ctx.textBaseline = 'alphabetic';
    ctx.textAlign = 'left';
    ctx.fillText(`−${fmtDuration(span)}`, left, cssH - 3);
    ctx.textAlign = 'right';
    ctx.fillText('now', left + w, cssH - 3);

    // max (or min) line
    const mark = opts.mark || 'max';
    const mv = stats[mark];
    if (mv !== null && mv > 0) {
      const my = Math.round(y(mv)) + 0.5;
      ctx.strokeStyle = '#d0d7de';
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      ctx.moveTo(left, my);
      ctx.lineTo(left + w, my);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = '#656d76';
      ctx.textAlign = 'left';
      ctx.textBaseline = 'bottom';
      ctx.fillText(mark + ' ' + opts.fmt(mv), left + 3, my - 1);
    }

    // the series, broken where a poll failed
    ctx.strokeStyle = opts.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    let prevY = null;
    for (let i = 0; i < data.length; i++) {
      const v = data[i];
      if (v === null) { pen = false; prevY = null; continue; }
      const px = x(i);
      const py = y(v);
      if (!pen) {
        ctx.moveTo(px, py);
        pen = true;
      } else {
        if (opts.steps && prevY !== null) ctx.lineTo(px, prevY);
        ctx.lineTo(px, py);
      }
      prevY = py;
    }
    ctx.stroke();

    // current value at the right edge
    if (current !== null) {
      let last = data.length - 1;
      while (last >= 0 && data[last] === null) last--;
      const cx = x(last);
      const cy = y(current);
      ctx.fillStyle = opts.color;
      ctx.beginPath();
      ctx.arc(cx, cy, 2.5, 0, Math.PI * 2);
      ctx.fill();
      ctx.textAlign = 'right';
      ctx.textBaseline = cy < top + 12 ? 'top' : 'bottom';
      ctx.fillText(opts.fmt(current), cx - 4, cy + (cy < top + 12 ? 3 : -3));
    }
  }

  function renderCharts() {
    const r = seriesStats(series.rate);
    const p = seriesStats(series.parts);
    setText($('rate-now'), r.current === null ? DASH : fmtRate(r.current));
    setText($('rate-max'), r.max === null ? DASH : fmtRate(r.max));
    setText($('parts-now'), p.current === null ? DASH : String(p.current));
    setText($('parts-max'), p.max === null ? DASH : String(p.max));
    const g = seriesStats(series.goodput);
    setText($('goodput-now'), fmtFixed(g.current, 1));
    setText($('goodput-min'), fmtFixed(g.min, 1));
    drawChart($('rate-chart'), series.rate, { color: '#0969da', integer: false, steps: false, fmt: fmtRate });
    drawChart($('parts-chart'), series.parts, { color: '#8250df', integer: true, steps: true, fmt: (v) => String(Math.round(v)) });
    drawChart($('goodput-chart'), series.goodput, { color: '#1a7f37', top: 100, mark: 'min', steps: false, fmt: (v) => v.toFixed(1) });
  }

  // ---------- events ----------

  const eventsList = $('events');
  const eventItems = new Map(); // seq -> <li>

  function eventText(ev) {
    const skip = new Set(['seq', 'ts', 'kind', 'replica_id']);
    const parts = [];
    if (ev.kind === 'state_changed') {
      parts.push(`${fmtValue(ev.from)} → ${fmtValue(ev.to)}`);
      ['from', 'to'].forEach((k) => skip.add(k));
    }
    for (const [k, v] of Object.entries(ev)) {
      if (skip.has(k)) continue;
      parts.push(`${k}=${fmtValue(v)}`);
    }
    return parts.join(' ');
  }

  function renderEvent(ev, seq) {
    const li = document.createElement('li');
    const kind = typeof ev.kind === 'string' ? ev.kind : 'unknown';
    const tone = Object.prototype.hasOwnProperty.call(EVENT_KINDS, kind) ? EVENT_KINDS[kind] : 'info';
    li.className = 'event k-' + tone;
    li.setAttribute('data-seq', String(seq));
    li.setAttribute('data-kind', kind);
    let full;
    try { full = JSON.stringify(ev); } catch (_) { full = ''; }
    li.setAttribute('title', `#${seq} ${new Date(isNum(ev.ts) ? ev.ts * 1000 : 0).toLocaleString()}\n${full}`);

    const time = document.createElement('span');
    time.className = 'ev-time';
    time.textContent = clockTime(ev.ts);
    const k = document.createElement('span');
    k.className = 'ev-kind';
    k.textContent = kind;
    li.append(time, k);
    if (ev.replica_id !== undefined && ev.replica_id !== null) {
      const rep = document.createElement('span');
      rep.className = 'ev-replica';
      rep.textContent = String(ev.replica_id);
      li.append(rep);
    }
    const text = document.createElement('span');
    text.className = 'ev-text';
    text.textContent = truncate(eventText(ev), 200);
    li.append(text);
    return li;
  }

  function addEvent(ev) {
    if (!ev || typeof ev !== 'object') return;
    const seq = Number(ev.seq);
    if (!Number.isFinite(seq) || eventItems.has(seq)) return;
    const oldest = eventsList.lastElementChild;
    if (eventItems.size >= MAX_EVENTS && oldest && seq < Number(oldest.getAttribute('data-seq'))) return;
    const li = renderEvent(ev, seq);
    // newest first: insert before the first item with a smaller seq
    let before = null;
    for (let child = eventsList.firstElementChild; child; child = child.nextElementSibling) {
      if (Number(child.getAttribute('data-seq')) < seq) { before = child; break; }
    }
    eventsList.insertBefore(li, before);
    eventItems.set(seq, li);
    while (eventItems.size > MAX_EVENTS) {
      const last = eventsList.lastElementChild;
      eventItems.delete(Number(last.getAttribute('data-seq')));
      last.remove();
    }
  }

  function clearEvents() {
    eventItems.clear();
    while (eventsList.firstChild) eventsList.firstChild.remove();
  }

  let source = null;
  let sseRetry = null;

  function setSseState(text, live) {
    const el = $('sse-state');
    setText(el, text);
    setClass(el, live ? 'live' : '');
  }

  function onSseMessage(msg) {
    let ev;
    try { ev = JSON.parse(msg.data); } catch (_) { return; }
    if (ev && typeof ev === 'object' && (ev.seq === undefined || ev.seq === null) && msg.lastEventId) {
      ev.seq = Number(msg.lastEventId);
    }
    addEvent(ev);
  }

  function connectEvents() {
    if (sseRetry !== null) { clearTimeout(sseRetry); sseRetry = null; }
    if (source) { source.close(); source = null; }
    if (typeof EventSource !== 'function') { setSseState('(polling)', false); return; }
    const es = new EventSource('events' + JOB_QUERY);
    source = es;
    es.onmessage = onSseMessage;
    for (const kind of Object.keys(EVENT_KINDS)) es.addEventListener(kind, onSseMessage);
    es.onopen = () => { if (source === es) setSseState('live', true); };
    es.onerror = () => {
      if (source !== es) return;
      if (es.readyState === EventSource.CLOSED) {
        // the browser gave up (e.g. an error status): retry ourselves; polls still fill the list
        setSseState('reconnecting…', false);
        source = null;
        sseRetry = setTimeout(connectEvents, SSE_RETRY_MS);
      } else {
        setSseState('reconnecting…', false);
      }
    };
  }

  // ---------- polling ----------

  function resetForNewLighthouse() {
    clearEvents();
    for (const k of SERIES) series[k].length = 0;
    prevStep = null;
    loadHistory();
  }

  function render(status) {
    const replicas = (Array.isArray(status.replicas) ? status.replicas : [])
      .filter((r) => r && typeof r === 'object' && r.replica_id !== undefined && r.replica_id !== null);
    const restarted = lastStatus !== null && isNum(status.started_unix_s) && isNum(lastStatus.started_unix_s) &&
      status.started_unix_s !== lastStatus.started_unix_s;
    const first = lastStatus === null;
    lastStatus = status;
    if (restarted) resetForNewLighthouse();
    if (first) loadHistory();

    renderHeader(status, replicas);
    renderReplicas(status, replicas);
    recordPoint(status, replicas);
    renderCharts();
    // On load (and as a fallback when the stream is down) merge the buffered events; duplicates are ignored by seq.
    if (Array.isArray(status.events)) for (const ev of status.events.slice(-100)) addEvent(ev);
    if (first || restarted) connectEvents();
  }

  async function fetchJson(path) {
    const ctrl = typeof AbortController === 'function' ? new AbortController() : null;
    const timer = ctrl ? setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS) : null;
    try {
      const resp = await fetch(path + JOB_QUERY, {
        cache: 'no-store',
        headers: { Accept: 'application/json' },
        signal: ctrl ? ctrl.signal : undefined,
      });
      if (!resp.ok) throw new Error('HTTP ' + resp.status);
      const body = await resp.json();
      if (!body || typeof body !== 'object' || Array.isArray(body)) throw new Error('unexpected response');
      return body;
    } catch (e) {
      if (e && e.name === 'AbortError') throw new Error('timeout');
      throw e;
    } finally {
      if (timer !== null) clearTimeout(timer);
    }
  }

  async function poll() {
    const started = performance.now();
    let status = null;
    try {
      status = await fetchJson('status');
    } catch (e) {
      setConnection(false, e);
      pushPoint(Date.now() / 1000, null, null, null);
      renderCharts();
    }
    if (status !== null) {
      setConnection(true);
      try {
        render(status);
      } catch (e) {
        setAction('dashboard error: ' + (e && e.message ? e.message : e), 'error');
        console.error(e);
      }
    }
    setTimeout(poll, Math.max(50, POLL_MS - (performance.now() - started)));
  }

  window.addEventListener('resize', renderCharts);
  setInterval(updateAge, 1000);
  updateAge();
  renderCharts();
  poll();
})();
