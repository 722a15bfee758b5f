// The deploy gate's dashboard: fetches the gate's JSON APIs every few seconds and renders them.
// Every value is put into the page as a text node (el() below), never as markup, so a reason
// holding "<script>" is shown as text. Actions POST with the approver token typed into the page
// (kept in sessionStorage for this tab only) as a Bearer header; the gate checks and audits it.
'use strict';
(() => {
  const TOKEN_KEY = 'flywheel.gate.token';
  const PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#8c564b'];
  const $ = (id) => document.getElementById(id);
  const detailCache = new Map(); // version -> {at, body}: version details change rarely
  let chart = null;
  let chartKey = '';
  let canAct = false; // the typed token is an approver's (GET api/me); the gate checks again anyway

  function el(tag, props, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else if (k.startsWith('data-') || k === 'title' || k === 'type') e.setAttribute(k, v);
      else e[k] = v;
    }
    for (const kid of kids.flat()) {
      if (kid === null || kid === undefined) continue;
      e.append(kid instanceof Node ? kid : String(kid)); // strings become text nodes
    }
    return e;
  }

  const fmt = (x, d = 3) => (x === null || x === undefined ? '–' : Number(x).toFixed(d));
  const pct = (x) => (x === null || x === undefined ? '–' : `${Number((100 * x).toFixed(1))}%`);
  const ci = (pair) => (pair ? `[${fmt(pair[0])}, ${fmt(pair[1])}]` : '–');
  const when = (s) => (s ? new Date(s).toISOString().replace('T', ' ').slice(0, 19) + ' UTC' : '–');
  const v = (x) => (x ? `v${x}` : '–');
  const empty = (text) => el('p', { class: 'muted' }, text);
  const ARM_ORDER = ['champion', 'challenger', 'holdout'];
  const armRank = (arm) => (ARM_ORDER.includes(arm) ? ARM_ORDER.indexOf(arm) : ARM_ORDER.length);
  // The page's bucket ("5m", "1h", "1d") in seconds, to pad the time axis around a lone bucket.
  const bucketSeconds = (b) => {
    const m = /^(\d+)([mhd])$/.exec(b || '1h');
    return m ? Number(m[1]) * { m: 60, h: 3600, d: 86400 }[m[2]] : 3600;
  };
  const KIND_ORDER = ['guardrail', 'reward_hacking', 'info'];
  const KIND_LABEL = { guardrail: 'guardrail', reward_hacking: 'reward hacking', info: 'information' };
  const badge = (ok, yes, no) => el('span', { class: ok ? 'badge ok' : 'badge bad' }, ok ? yes : no);

  // A table from column specs [{label, num, key}] and rows of cells (text or nodes).
  function table(columns, rows, rowProps) {
    const head = el('tr', null, columns.map((c) => el('th', { class: c.num ? 'num' : null }, c.label)));
    const body = rows.map((cells, i) =>
      el('tr', rowProps ? rowProps(i) : null,
        cells.map((cell, j) => el('td', {
          class: columns[j].num ? 'num' : null,
          'data-field': columns[j].key || null,
        }, cell))));
    return el('table', null, el('thead', null, head), el('tbody', null, body));
  }

  function fill(id, ...nodes) {
    $(id).replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined));
  }

  async function load(path) {
    const r = await fetch(path, { headers: { Accept: 'application/json' }, cache: 'no-store' });
    if (r.status === 404) return null;
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  function say(text, bad) {
    const m = $('msg');
    m.textContent = text;
    m.className = bad ? 'alarm' : 'okmsg';
  }

  // ---- sections ------------------------------------------------------------------------

  // The controller's warnings that are not (yet) a rollback, e.g. reward up while explicit thumbs go down.
  const flagList = (flags) => (flags && flags.length
    ? el('ul', { class: 'flags' }, flags.map((f) => el('li', { 'data-field': 'flag' },
      el('span', { class: 'badge bad' }, 'warning'), ' ', f)))
    : null);

  function renderRollout(exp, splitView) {
    const split = splitView && splitView.split;
    const parts = [];
    if (exp) {
      parts.push(el('p', null,
        el('span', { class: `state ${exp.state}`, 'data-field': 'experiment-state' }, exp.state), ' ',
        exp.challenger
          ? `champion ${v(exp.champion)}, challenger ${v(exp.challenger)} at ${pct(exp.share)} of users`
          : `champion ${v(exp.champion)}, no challenger`,
        exp.holdout_version ? `, holdout ${v(exp.holdout_version)}` : ''));
    }
    const a = exp && exp.analysis;
    if (a) {
      const d = a.decision;
      parts.push(el('p', null, 'Controller decision: ',
        el('b', { 'data-field': 'decision-action' }, d.action), ` (${when(d.at)}): `,
        el('span', { class: 'reason', 'data-field': 'decision-reason' }, d.reason)));
      parts.push(flagList(a.flags));
    } else {
      // Idle (or the API is absent): the controller has not analysed a challenger with rewards yet.
      parts.push(el('p', { class: 'muted', id: 'no-analysis' },
        'No experiment analysis yet: the rollout controller has not analysed a challenger with rewards. ' +
        'Per-arm figures below come from the metrics API.'));
    }
    if (split) {
      const share = split.challenger_version ? split.challenger_share : 0;
      parts.push(el('p', { class: 'muted' },
        el('span', { class: `state ${split.state}` }, split.state), ' traffic split: ',
        `champion ${v(split.champion_version)} ${pct(1 - share)}, `,
        split.challenger_version ? `challenger ${v(split.challenger_version)} ${pct(share)}` : 'no challenger',
        `. Last change by ${split.changed_by} at ${when(split.changed_at)}: `,
        el('span', { class: 'reason' }, split.reason)));
    } else if (!exp) {
      parts.push(empty('No traffic split yet: the first gate action creates it with the champion.'));
    }
    fill('rollout', parts);
  }

  function renderArms(exp, metrics) {
    const a = exp && exp.analysis;
    if (a) {
      const rows = ['champion', 'challenger'].filter((k) => a.arms[k]).map((k) => {
        const arm = a.arms[k];
        return [k, v(k === 'champion' ? exp.champion : exp.challenger), String(arm.users),
          String(arm.generations), fmt(arm.mean), ci(arm.ci)];
      });
      fill('arms', el('p', { class: 'muted small' },
        `Unit: ${a.unit}; metric ${a.metric}; reward definition ${a.reward_version}. ` +
        'Intervals are per-user (the randomised unit).'),
      table([{ label: 'arm', key: 'arm' }, { label: 'version', key: 'version' },
        { label: 'users', num: true, key: 'users' }, { label: 'generations', num: true, key: 'n' },
        { label: 'mean', num: true, key: 'mean' }, { label: '95% CI', num: true, key: 'ci' }],
      rows, (i) => ({ 'data-arm': rows[i][0] })));
      return;
    }
    if (!metrics || !metrics.arms.length) {
      fill('arms', empty('No rewards yet: figures appear once signals have written rewards.'));
      return;
    }
    const rows = metrics.arms.map((arm) => [arm.arm, v(arm.model_version), String(arm.n), fmt(arm.mean),
      arm.ci_low === null ? '–' : ci([arm.ci_low, arm.ci_high]),
      Object.entries(arm.label_sources).map(([s, n]) => `${s} ${pct(n / arm.n)}`).join(', ')]);
    fill('arms', el('p', { class: 'muted small' },
      `Per-generation means of reward definition ${metrics.reward_version}, ${pct(metrics.confidence)} intervals.`),
    table([{ label: 'arm', key: 'arm' }, { label: 'version', key: 'version' },
      { label: 'generations', num: true, key: 'n' }, { label: 'mean reward', num: true, key: 'mean' },
      { label: '95% CI', num: true, key: 'ci' }, { label: 'label sources', key: 'sources' }],
    rows, (i) => ({ 'data-arm': rows[i][0] })));
  }

  // Series per arm: [{arm, label, points: [{t, mean, lo, hi, n}]}]: the experiment's per-user series
  // while the controller has an analysis (the series then covers the same arms and versions), else
  // the metrics API's per-generation buckets.
  function chartSeries(exp, series, metrics) {
    if (exp && exp.analysis && series && series.buckets && series.buckets.length) {
      const byArm = new Map();
      for (const b of series.buckets) {
        if (!byArm.has(b.arm)) byArm.set(b.arm, []);
        byArm.get(b.arm).push({ t: Date.parse(b.start) / 1000, mean: b.mean, lo: b.ci ? b.ci[0] : null,
          hi: b.ci ? b.ci[1] : null, n: b.users });
      }
      const version = { champion: exp.champion, challenger: exp.challenger, holdout: exp.holdout_version };
      return {
        unit: 'users',
        arms: [...byArm].sort(([x], [y]) => armRank(x) - armRank(y)).map(([arm, points]) => ({
          arm, label: version[arm] ? `${arm} v${version[arm]}` : arm, points: points.filter((p) => p.mean !== null) })),
      };
    }
    if (!metrics) return { unit: 'n', arms: [] };
    return {
      unit: 'generations',
      arms: metrics.arms.map((a) => ({
        arm: a.arm,
        label: `${a.arm} v${a.model_version}`,
        points: a.buckets.filter((b) => b.mean !== null).map((b) => ({
          t: Date.parse(b.start) / 1000, mean: b.mean, lo: b.ci_low, hi: b.ci_high, n: b.n })),
      })),
    };
  }

  function renderChart(exp, series, metrics) {
    const s = chartSeries(exp, series, metrics);
    const note = $('chart-note');
    if (!s.arms.length || !s.arms.some((a) => a.points.length)) {
      if (chart) { chart.destroy(); chart = null; chartKey = ''; }
      $('chart-legend').replaceChildren();
      note.textContent = 'No rewards yet: the chart appears once signals have written rewards.';
      return;
    }
    note.textContent = `Mean satisfaction per ${document.body.dataset.bucket} bucket (UTC); the shaded band is ` +
      `each arm's 95% interval. Hover the chart for a bucket's figures and ${s.unit}.`;
    const key = JSON.stringify(s);
    if (key === chartKey && chart) return;
    chartKey = key;
    const xs = [...new Set(s.arms.flatMap((a) => a.points.map((p) => p.t)))].sort((a, b) => a - b);
    const newest = xs[xs.length - 1];
    if (xs.length === 1) { // one bucket alone gets an axis of years: add an empty bucket either side
      const step = bucketSeconds(document.body.dataset.bucket);
      xs.unshift(newest - step);
      xs.push(newest + step);
    }
    const data = [xs];
    const seriesOpts = [{}];
    const bands = [];
    s.arms.forEach((arm, i) => {
      const color = PALETTE[i % PALETTE.length];
      const at = new Map(arm.points.map((p) => [p.t, p]));
      const col = (f) => xs.map((x) => (at.has(x) && at.get(x)[f] !== null ? at.get(x)[f] : null));
      const base = data.length;
      data.push(col('mean'), col('lo'), col('hi'), col('n'));
      seriesOpts.push(
        { label: arm.label, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 6 },
          value: (u, y) => fmt(y) },
        { label: `${arm.label} low`, stroke: color + '66', width: 1, spanGaps: true, points: { show: false },
          value: (u, y) => fmt(y) },
        { label: `${arm.label} high`, stroke: color + '66', width: 1, spanGaps: true, points: { show: false },
          value: (u, y) => fmt(y) },
        { label: `${arm.label} ${s.unit}`, show: false, value: (u, y) => (y === null ? '–' : String(y)) });
      bands.push({ series: [base + 2, base + 1], fill: color + '22' });
    });
    const box = $('chart');
    const width = Math.max(320, Math.min(box.clientWidth || 900, 1100));
    // Our own legend (uPlot's would list every band edge): one line per arm, the hovered bucket's figures.
    const legend = (idx) => {
      const at = idx === null || idx === undefined ? xs.indexOf(newest) : idx;
      $('chart-legend').replaceChildren(...s.arms.map((arm, i) => {
        const p = arm.points.find((q) => q.t === xs[at]);
        return el('span', { class: 'entry', 'data-arm': arm.arm },
          el('span', { class: `swatch c${i % PALETTE.length}` }), el('b', null, arm.label), ' ',
          p ? `${fmt(p.mean)} ${p.lo === null ? '' : ci([p.lo, p.hi])} (${s.unit} ${p.n})` : '–');
      }), el('span', { class: 'muted small' }, `bucket of ${when(new Date(xs[at] * 1000).toISOString())}`));
    };
    if (chart) chart.destroy();
    box.replaceChildren();
    chart = new uPlot({ // eslint-disable-line no-undef
      width, height: 300, series: seriesOpts, bands,
      scales: { x: { time: true } },
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), 'Etc/UTC'), // eslint-disable-line no-undef
      axes: [{ label: 'bucket start (UTC)' }, { label: 'satisfaction', values: (u, ticks) => ticks.map((t) => fmt(t, 2)) }],
      legend: { show: false },
      hooks: { setCursor: [(u) => legend(u.cursor.idx)] },
    }, data, box);
    legend(null);
  }

  function renderDifference(exp) {
    const a = exp && exp.analysis;
    if (!a) {
      // Before the challenger has rewards the gate still says what this traffic could resolve.
      fill('difference', exp && exp.plan
        ? el('p', { class: 'muted', 'data-field': 'power-note' }, exp.plan.note)
        : empty('No experiment analysis yet.'));
      fill('srm', empty('No experiment analysis yet.'));
      return;
    }
    const d = a.difference;
    if (d) renderEffect(d, a.power, a.rule, a.capping, a.segments); // null while an arm has too few users
    else {
      // No challenger reward yet (a.no_data): what the traffic could resolve, from the champion's users.
      const note = a.no_data && exp.plan ? exp.plan.note : a.power ? a.power.note : '';
      fill('difference', el('p', { class: 'muted' }, 'Too few users in an arm for an interval yet. ',
        el('span', { 'data-field': 'power-note' }, note)), ruleLine(a.rule));
    }
    const srm = a.srm;
    fill('srm', el('p', null, badge(!srm.alarm, 'no mismatch', 'MISMATCH: ramp frozen'),
      ` sequential p = ${srm.p_value === null ? '–' : srm.p_value.toPrecision(3)} over ${srm.periods} period(s); ` +
      `users observed ${srm.observed.join(' / ')} since ${srm.since ? when(srm.since) : 'the start'}, ` +
      `against the shares in force ${srm.expected_shares.map(pct).join(' / ')}.`,
      el('span', { class: 'muted small' }, ` ${srm.method || ''}`)));
  }

  // The decision rule in force and what it risks (`RuleView`): which rule promotes, and the chance it promotes
  // a challenger worse by the margin.
  function ruleLine(rule) {
    if (!rule) return '';
    return el('p', { 'data-field': 'decision-rule' }, el('strong', null, `Decision rule: ${rule.name}. `),
      rule.summary, '. ', el('span', { class: 'muted small', 'data-field': 'rule-risk' }, rule.note));
  }

  // Reward per generation by surface: informational, never decided on (several surfaces, every look).
  const segmentTable = (segments) => (segments && segments.length
    ? table([{ label: 'surface' }, { label: 'users', num: true }, { label: 'champion', num: true },
      { label: 'challenger', num: true }, { label: 'difference', num: true }, { label: 'interval' },
      { label: 'relative' }], segments.map((s) => [s.surface, s.users.join(' / '), fmt(s.means[0]), fmt(s.means[1]),
      fmt(s.difference), ci(s.ci), s.relative_estimate === null ? '–'
        : `${pct(s.relative_estimate)} [${pct(s.relative_ci[0])}, ${pct(s.relative_ci[1])}]`]),
    (i) => ({ 'data-segment': segments[i].surface }))
    : el('span', { class: 'muted' }, 'no surface seen yet'));

  function renderEffect(d, power, rule, capping, segments) {
    // What decides: the always-valid interval of the regression-adjusted, step-stratified difference.
    const seq = d.sequential_ci;
    const decisive = d.decisive !== false;
    const verdict = !decisive ? 'not enough evidence yet' : seq[0] > 0 ? 'challenger better'
      : seq[1] < 0 ? 'challenger worse' : 'not yet decided';
    const cls = !decisive ? 'badge' : seq[0] > 0 ? 'badge ok' : seq[1] < 0 ? 'badge bad' : 'badge';
    const num = (x) => (x === null || x === undefined ? '–' : x.toPrecision(3));
    const facts = [
      el('dt', null, 'estimate (adjusted)'), el('dd', { 'data-field': 'diff-adjusted' }, fmt(d.adjusted_estimate)),
      el('dt', null, 'relative lift'), el('dd', { 'data-field': 'diff-relative' }, d.relative_estimate === null
        || d.relative_estimate === undefined ? '– (the champion\'s mean is not above 0)'
        : `${d.relative_estimate > 0 ? '+' : ''}${pct(d.relative_estimate)} [${pct(d.relative_ci[0])}, `
          + `${pct(d.relative_ci[1])}]`, ' ', el('span', { class: 'muted small' },
        `(each arm's mean, fixed-sample ${pct(1 - d.alpha)} interval, delta method: shown, not decided on)`)),
      el('dt', null, `always-valid ${pct(1 - d.alpha)} interval`),
      el('dd', { 'data-field': 'diff-sequential' }, ci(seq), ' ', el('span', { class: cls }, verdict)),
      el('dt', null, 'sequential p'), el('dd', { 'data-field': 'diff-p' }, num(d.p_value)),
      el('dt', null, 'estimate (unadjusted)'), el('dd', { 'data-field': 'diff-estimate' }, fmt(d.estimate)),
      el('dt', null, 'unadjusted always-valid interval'), el('dd', null, ci(d.unadjusted_sequential_ci)),
      el('dt', null, 'expected loss (reward per generation)'), el('dd', { 'data-field': 'diff-loss' },
        `shipping the challenger ${num(d.expected_loss_ship)}, keeping the champion ${num(d.expected_loss_keep)} `,
        el('span', { class: 'muted small' }, rule && rule.name === 'expected_loss'
          ? `(decides at the end, its planned size or the maximum duration: ships below ${num(rule.threshold)})`
          : '(shown for reference: the always-valid interval decides)')),
      el('dt', null, 'variance removed by adjustment'),
      el('dd', { 'data-field': 'diff-reduction' }, d.variance_reduction === null ? '–' : pct(d.variance_reduction)),
      el('dt', null, 'by ramp step'), el('dd', { class: 'small' }, (d.strata || []).map((s) =>
        `step ${s.step}: ${s.users.join(' / ')} users, ${s.estimate === null ? '–' : fmt(s.estimate)}`).join('; ')),
      el('dt', null, 'fixed-sample interval'), el('dd', null, ci(d.ci), ' ',
        el('span', { class: 'muted small' }, '(reference only: not valid when looked at repeatedly)')),
      el('dt', null, 'method'), el('dd', { class: 'small' }, d.method),
      el('dt', null, 'by surface'), el('dd', { 'data-field': 'segments', class: 'small' }, segmentTable(segments),
        el('span', { class: 'muted small' }, 'informational: a segment decides nothing (the decision is on all users)')),
      el('dt', null, 'heavy users capped'), el('dd', { 'data-field': 'capping', class: 'small' }, !capping ? 'off'
        : `at the ${Number((100 * capping.percentile).toFixed(2))}th percentile of generations per user, both arms pooled (`
          + (capping.cap_generations === null ? 'no cap yet'
            : `${fmt(capping.cap_generations, 0)} generations; ${capping.users_capped} users capped`)
          + '): each counts as at most that many, their own rates kept'),
    ];
    if (power) {
      facts.push(el('dt', null, 'what this traffic can resolve'),
        el('dd', { 'data-field': 'power-note' }, power.note),
        el('dt', null, 'users needed (80% power)'), el('dd', { 'data-field': 'power-users', class: 'small' },
          Object.entries(power.users_for_changes)
            .map(([k, n]) => `${k} in the champion's accept rate: ${n === null ? '–' : n}`).join('; ')),
        el('dt', null, 'non-inferiority margin'), el('dd', { 'data-field': 'power-margin', class: 'small' },
          power.margin === null ? 'none (no accepts yet): only a significant win promotes'
            : `${num(power.margin)} = ${pct(power.margin_share)} of the accept rate ${num(power.champion_accept_rate)}`
              + ` x ${power.reward_per_accept} reward per accept; needs ${power.users_for_margin === null ? '–'
                : power.users_for_margin} users`
              + (power.margin_reachable === false ? ' (more than this traffic brings: it cannot decide)' : '')));
    }
    fill('difference', ruleLine(rule), el('dl', { class: 'facts' }, ...facts));
  }

  // The chat sycophancy check's verdict (absent without chat replies): its figures are the rows it names.
  const SYCOPHANCY_LABEL = { flagged: 'flagged', clear: 'clear', not_enough_evidence: 'not enough evidence' };
  const sycophancyLine = (s) => (s
    ? el('p', { id: 'sycophancy' }, 'Sycophancy check (chat): ',
      el('span', { class: s.status === 'flagged' ? 'badge bad' : s.status === 'clear' ? 'badge ok' : 'badge',
        'data-field': 'sycophancy-status' }, SYCOPHANCY_LABEL[s.status] || s.status), ' ',
      el('span', { class: 'reason', 'data-field': 'sycophancy-reason' }, s.reason),
      el('span', { class: 'muted small' }, ` (rows: ${s.checks.join(', ')}; a flagged challenger is not promoted)`))
    : null);

  function renderGuardrails(exp) {
    const a = exp && exp.analysis;
    if (!a) { fill('guardrails', empty('No experiment analysis yet.')); } else if (!a.guardrails.length) {
      fill('guardrails', empty('No guardrail reported.'));
    } else {
      // Guardrails first, then the reward-hacking checks (fewer accepts, empty outputs, length drift),
      // then the rates shown for information only (shown, declined), which never trip.
      const rank = (g) => KIND_ORDER.indexOf(g.kind);
      const rails = a.guardrails.slice().sort((x, y) => rank(x) - rank(y));
      fill('guardrails', table(
        [{ label: 'check', key: 'name' }, { label: 'kind', key: 'kind' }, { label: 'champion', num: true, key: 'champion' },
          { label: 'challenger', num: true, key: 'challenger' }, { label: 'always-valid interval of the change', key: 'ci' },
          { label: 'bound' }, { label: '', key: 'ok' }],
        rails.map((g) => [g.name, KIND_LABEL[g.kind], fmt(g.champion), fmt(g.challenger), g.ci ? ci(g.ci) : '–', g.bound,
          g.kind === 'info' ? el('span', { class: 'badge' }, 'info') : badge(g.ok, 'ok', 'breached')]),
        (i) => ({ 'data-guardrail': rails[i].name })), sycophancyLine(a.sycophancy));
    }
    const h = exp && exp.holdout;
    if (!h) {
      fill('holdout', empty(exp ? 'No holdout configured.' : 'No experiment analysis yet.'));
      return;
    }
    const eff = h.cumulative_effect;
    fill('holdout', el('p', null,
      `${pct(h.share)} of users stay on ${v(h.version)} (${h.users} users, mean ${fmt(h.mean)}). `,
      'Cumulative effect of the releases since: ', el('b', null, eff ? fmt(eff.estimate) : '–'),
      eff ? ` ${ci(eff.ci)}` : ''));
  }

  // The duration calculator (`flywheel gate plan`): at the traffic and accept rate typed in, else measured on
  // the running experiment. The same plan before an experiment starts (type both) and while it runs.
  async function renderPlan() {
    const q = [['plan-users', 'users_per_day'], ['plan-accept', 'accept_rate']]
      .filter(([id]) => $(id).value.trim() !== '').map(([id, k]) => `${k}=${encodeURIComponent($(id).value.trim())}`);
    let p = null;
    try { p = await load(`api/experiment/plan${q.length ? `?${q.join('&')}` : ''}`); } catch (e) {
      fill('plan', el('p', { class: 'muted' }, `plan: ${e.message}`));
      return;
    }
    if (!p) {
      fill('plan', empty('Type the new users a day and the champion\'s accept rate (nothing measured yet).'));
      return;
    }
    fill('plan', el('p', { 'data-field': 'plan-source', class: 'muted small' }, p.measured
      ? `measured on the running experiment: ${fmt(p.users_per_day, 0)} users a day, accept rate ${fmt(p.accept_rate)}`
      : `at ${fmt(p.users_per_day, 0)} users a day, accept rate ${fmt(p.accept_rate)}`),
    el('p', null, badge(p.reachable, 'ramp fits', 'ramp does NOT fit the maximum duration')),
    el('ul', { 'data-field': 'plan-lines', class: 'small' }, p.lines.map((line) => el('li', null, line))));
  }

  function renderRamp(exp) {
    if (!exp) {
      fill('ramp', empty('No experiment analysis yet.'));
      fill('timeline');
      return;
    }
    const ramp = exp.ramp || [];
    const timeline = exp.timeline || [];
    const rows = ramp.map((r) => [pct(r.share), String(r.min_users), `${Math.round(r.min_seconds / 60)} min`,
      when(r.entered_at), r.left_at ? when(r.left_at) : r.entered_at ? 'current' : '–']);
    fill('ramp', rows.length ? table([{ label: 'share' }, { label: 'min users', num: true },
      { label: 'min time', num: true }, { label: 'entered' }, { label: 'left' }], rows,
    (i) => ({ class: ramp[i].entered_at && !ramp[i].left_at ? 'current' : null }))
      : empty('No ramp configured.'));
    fill('timeline', timeline.length
      ? el('ul', { class: 'timeline' }, timeline.slice().reverse().map((t) =>
        el('li', null, el('span', { class: 'muted' }, when(t.at)), ' ', el('b', null, t.event), ` by ${t.by}`)))
      : null);
  }

  // An offline gate has three verdicts: passed, failed (refused) and insufficient evidence, which never
  // blocks but is no pass either: it is shown as undecided, never with a pass's tick.
  const GATE_MARK = { passed: ['badge ok', '✓'], failed: ['badge bad', '✗'], insufficient_evidence: ['badge', '?'],
    undecided: ['badge', '?'] };

  function gatesCell(gates) {
    if (!gates) return el('span', { class: 'muted' }, 'not run');
    if (!gates.length) return el('span', { class: 'muted' }, 'none');
    return el('span', null, gates.map((g) => {
      const [cls, mark] = GATE_MARK[g.status] || (g.passed ? GATE_MARK.passed : GATE_MARK.failed);
      return el('span', { class: cls, 'data-gate': g.name, 'data-status': g.status,
        title: `${g.name}: ${fmt(g.value, 4)} (bound ${g.bound})${g.detail ? ' — ' + g.detail : ''}` },
      `${g.name} ${mark}`);
    }));
  }

  const OFFLINE_VERDICT = {
    passed: 'passed: not worse than the champion beyond the margin',
    failed: 'refused: significantly worse than the champion, it never reaches users',
    insufficient_evidence: 'could not decide yet',
  };

  function renderOffline(exp, versions, gatesOf) {
    // The off-policy estimate of the challenger (else of the newest candidate waiting), in words: what
    // it predicts before users see the version, and when it cannot tell, why (the gate's own detail).
    const challenger = exp && exp.challenger;
    const pending = versions.filter((x) => x.gate_state === 'pending');
    const ver = challenger || (pending.length ? pending[0].version : null);
    const ope = ver ? (gatesOf(ver) || []).find((g) => g.name === 'ope_satisfaction') : null;
    if (!ope) {
      const failed = ver && gatesOf.error(ver);
      fill('offline', empty(failed ? `Could not load ${v(ver)}'s offline gates: ${failed}`
        : ver ? `No off-policy estimate for ${v(ver)} yet.` : 'No challenger or candidate.'));
      return;
    }
    fill('offline', el('p', null, `${challenger ? 'Challenger' : 'Candidate'} ${v(ver)}: `,
      el('b', { 'data-field': 'offline-value' }, ope.value === null ? '–' : fmt(ope.value)),
      ' (DR − champion\'s logged mean reward) ',
      el('span', { class: (GATE_MARK[ope.status] || GATE_MARK.failed)[0], 'data-field': 'offline-status' },
        OFFLINE_VERDICT[ope.status] || ope.status), ' ',
      el('span', { class: 'reason small', 'data-field': 'offline-detail' }, ope.detail)));
  }

  async function versionDetails(versions) {
    const now = Date.now();
    const wanted = versions.slice(0, 10).map((x) => x.version);
    await Promise.all(wanted.map(async (ver) => {
      const c = detailCache.get(ver);
      if (c && now - c.at < 60000) return;
      try {
        detailCache.set(ver, { at: now, body: await load(`api/versions/${encodeURIComponent(ver)}`) });
      } catch (e) { detailCache.set(ver, { at: 0, error: e.message }); /* said, and tried again next refresh */ }
    }));
    const gatesOf = (ver) => { const c = detailCache.get(ver); return c && c.body ? c.body.offline_gates : undefined; };
    gatesOf.error = (ver) => { const c = detailCache.get(ver); return c && c.error; };
    return gatesOf;
  }

  function renderVersions(versions, gatesOf) {
    const pending = versions.filter((x) => x.gate_state === 'pending');
    fill('pending', pending.length ? table(
      [{ label: 'version', key: 'version' }, { label: 'registered' }, { label: 'parent' },
        { label: 'samples', num: true }, { label: 'offline gates' }, { label: '' }],
      pending.map((x) => {
        const path = `api/versions/${encodeURIComponent(x.version)}`;
        return [v(x.version), when(x.created_at), v(x.parent_version), String(x.sample_count),
          gatesCell(gatesOf(x.version)),
          el('span', { class: 'buttons' },
            el('button', { type: 'button', 'data-action': `${path}/approve`, 'data-version': x.version }, 'approve'),
            el('button', { type: 'button', class: 'danger', 'data-action': `${path}/reject`,
              'data-version': x.version }, 'reject'))];
      }), (i) => ({ 'data-version': pending[i].version }))
      : empty('No candidate waits for approval.'));
    fill('versions', versions.length ? table(
      [{ label: 'version' }, { label: 'gate state', key: 'gate-state' }, { label: 'aliases' },
        { label: 'parent (lineage)' }, { label: 'registered' }, { label: 'samples', num: true },
        { label: 'offline gates' }],
      versions.slice(0, 20).map((x) => [v(x.version), el('span', { class: `state ${x.gate_state}` }, x.gate_state),
        x.aliases.join(', '), v(x.parent_version), when(x.created_at), String(x.sample_count),
        gatesCell(gatesOf(x.version))]),
      (i) => ({ 'data-version': versions[i].version }))
      : empty('No model version registered yet.'));
  }

  function stateText(s) {
    if (!s) return '–';
    const parts = [];
    if (s.gate_state) parts.push(`v${s.version} ${s.gate_state}`);
    if (s.split) {
      parts.push(`${s.split.state}: champion v${s.split.champion}` +
        (s.split.challenger ? `, challenger v${s.split.challenger} ${pct(s.split.challenger_share)}` : ''));
    }
    return parts.join('; ') || '–';
  }

  function renderAudit(page) {
    const entries = (page && page.entries) || [];
    fill('audit', entries.length ? table(
      [{ label: 'when' }, { label: 'who', key: 'who' }, { label: 'role', key: 'role' },
        { label: 'action', key: 'action' }, { label: 'target' }, { label: 'outcome', key: 'outcome' },
        { label: 'why', key: 'reason' }, { label: 'before → after' }, { label: 'detail' }],
      entries.map((e) => [when(e.at), e.who, e.role, e.action, e.target,
        badge(e.allowed, 'allowed', 'refused'), el('span', { class: 'reason' }, e.reason),
        el('span', { class: 'small' }, stateText(e.before), e.after ? ` → ${stateText(e.after)}` : ''),
        el('span', { class: 'small muted' }, e.detail)]),
      (i) => ({ class: entries[i].allowed ? null : 'refused' }))
      : empty('No action recorded yet.'));
  }

  async function whoami() {
    const token = $('token').value.trim();
    const who = $('whoami');
    if (!token) {
      canAct = false;
      who.textContent = 'No token: enter an approver token to approve, reject, promote or roll back.';
      who.className = 'muted';
    } else {
      const r = await fetch('api/me', { headers: { Authorization: `Bearer ${token}` }, cache: 'no-store' });
      const me = r.ok ? await r.json() : null;
      canAct = Boolean(me && me.can_approve);
      who.textContent = me ? `Acting as ${me.name} (${me.role})${canAct ? '' : ': this role cannot approve'}.`
        : 'This token is unknown or revoked.';
      who.className = canAct ? 'okmsg' : 'alarm';
    }
    for (const b of document.querySelectorAll('button[data-action]')) {
      b.disabled = !canAct;
      b.title = canAct ? '' : 'needs an approver token';
    }
  }

  // ---- refresh loop ----------------------------------------------------------------------

  async function refresh() {
    // The page's bucket if one was asked for (?bucket=), else the experiment's own (minutes for a demo).
    if (!document.body.dataset.bucketAsked) {
      try { document.body.dataset.bucket = (await load('api/experiment')).bucket || '1h'; } catch (e) { /* idle */ }
    }
    const bucket = encodeURIComponent(document.body.dataset.bucket || '1h');
    const got = await Promise.allSettled([
      load('api/experiment'), load('api/split'), load('api/versions'), load('api/audit?limit=50'),
      load(`api/metrics/arms?bucket=${bucket}`),
    ]);
    const [exp, split, versions, audit, metrics] = got.map((r) => (r.status === 'fulfilled' ? r.value : undefined));
    let series = null;
    if (exp && exp.analysis) {
      try { series = await load(`api/experiment/series?bucket=${bucket}`); } catch (e) { series = null; }
    }
    const failed = got.filter((r) => r.status === 'rejected').map((r) => r.reason.message);
    renderRollout(exp, split);
    renderArms(exp, metrics);
    renderDifference(exp);
    renderGuardrails(exp);
    renderRamp(exp);
    await renderPlan();
    if (versions) {
      const gatesOf = await versionDetails(versions);
      renderVersions(versions, gatesOf);
      renderOffline(exp, versions, gatesOf);
    }
    if (audit) renderAudit(audit);
    await whoami().catch(() => { canAct = false; });
    try { renderChart(exp, series, metrics); } catch (e) { $('chart-note').textContent = `chart: ${e.message}`; }
    const up = $('updated');
    up.textContent = failed.length ? `could not load ${failed.join('; ')}` : `updated ${new Date().toLocaleTimeString()}`;
    up.className = failed.length ? 'alarm' : '';
    document.body.dataset.loaded = 'true';
  }

  async function act(button) {
    const reason = $('reason').value.trim();
    if (!reason) {
      say('Say why first: the reason is kept in the audit log.', true);
      $('reason').focus();
      return;
    }
    const token = $('token').value.trim();
    const headers = { 'Content-Type': 'application/json', Accept: 'application/json' };
    if (token) headers.Authorization = `Bearer ${token}`;
    button.disabled = true;
    try {
      const r = await fetch(button.dataset.action, { method: 'POST', headers, body: JSON.stringify({ reason }) });
      const body = await r.json().catch(() => ({}));
      if (r.ok) {
        say(`Done: ${body.plan.action} ${body.plan.version || ''} (by ${body.plan.by}).`, false);
      } else {
        const detail = typeof body.detail === 'string' ? body.detail : JSON.stringify(body.detail || body);
        say(`Refused (${r.status}): ${detail}`, true);
      }
    } catch (e) {
      say(`Could not reach the gate: ${e.message}`, true);
    } finally {
      button.disabled = !canAct;
    }
    await refresh();
  }

  function loop() {
    const every = Number(document.body.dataset.refreshMs) || 5000;
    refresh().catch((e) => { $('updated').textContent = `error: ${e.message}`; })
      .finally(() => setTimeout(loop, every));
  }

  document.addEventListener('DOMContentLoaded', () => {
    const token = $('token');
    token.value = sessionStorage.getItem(TOKEN_KEY) || '';
    token.addEventListener('input', () => {
      sessionStorage.setItem(TOKEN_KEY, token.value.trim());
      whoami().catch(() => { canAct = false; });
    });
    $('forget').addEventListener('click', () => {
      sessionStorage.removeItem(TOKEN_KEY);
      token.value = '';
      whoami().catch(() => { canAct = false; });
    });
    for (const f of document.querySelectorAll('form')) f.addEventListener('submit', (e) => e.preventDefault());
    for (const id of ['plan-users', 'plan-accept']) $(id).addEventListener('change', () => renderPlan());
    document.addEventListener('click', (e) => {
      const b = e.target.closest('button[data-action]');
      if (b) act(b);
    });
    loop();
  });
})();
