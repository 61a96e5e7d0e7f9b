// The live dashboard of `pagoda serve` (GET /dashboard): polls /metrics (open, no API key
// needed) every POLL_MS, computes the Grafana dashboard's panels in the browser (rates of
// counters, histogram quantiles over a sliding window, as PromQL's rate() and
// histogram_quantile() do) and draws them with uPlot (vendored, MIT).
(function () {
  "use strict";
  const POLL_MS = 1500;
  const WINDOW_S = 300; // seconds of history on the charts
  const RATE_WINDOW_S = 10; // counters' rates over this window
  const QUANTILE_WINDOW_S = 30; // histograms' quantiles over this window
  const COLORS = ["#2f6fdb", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0b7285"];

  const ms = (v) => (v == null ? null : v * 1000);
  const pct = (v) => (v == null ? null : v * 100);
  const q = (name, p) => (s) => ms(s.quantile(name, p));
  const PANELS = [
    { title: "Time to first token", unit: "ms", series: [
      ["p50", q("time_to_first_token_seconds", 0.5)],
      ["p95", q("time_to_first_token_seconds", 0.95)],
      ["p99", q("time_to_first_token_seconds", 0.99)]] },
    { title: "Time per output token / inter-token latency", unit: "ms", series: [
      ["TPOT p50", q("request_time_per_output_token_seconds", 0.5)],
      ["TPOT p99", q("request_time_per_output_token_seconds", 0.99)],
      ["ITL p50", q("inter_token_latency_seconds", 0.5)],
      ["ITL p99", q("inter_token_latency_seconds", 0.99)]] },
    { title: "End-to-end request latency", unit: "ms", series: [
      ["p50", q("e2e_request_latency_seconds", 0.5)],
      ["p95", q("e2e_request_latency_seconds", 0.95)],
      ["p99", q("e2e_request_latency_seconds", 0.99)]] },
    { title: "Token throughput", unit: "tokens/s", series: [
      ["prompt", (s) => s.rate("prompt_tokens_total")],
      ["generation", (s) => s.rate("generation_tokens_total")]] },
    { title: "Requests running / waiting", unit: "requests", series: [
      ["running", (s) => s.value("num_requests_running")],
      ["waiting", (s) => s.value("num_requests_waiting")],
      ["deferred", (s) => s.value("num_requests_waiting_by_reason", { reason: "deferred" })]] },
    { title: "Admission rejections", unit: "req/s", series: ["max_num_queued_reqs",
      "grammar_compile_backlog", "grammar_max_abandoned"].map((r) =>
      [r, (s) => s.rate("admission_rejections_total", { reason: r })]) },
    { title: "KV-cache usage", unit: "%", series: [
      ["used", (s) => pct(s.value("kv_cache_usage_perc"))]] },
    { title: "Prefix-cache hit rate", unit: "%", series: [
      ["hit rate", (s) => pct(s.ratio("prefix_cache_hits_total", "prefix_cache_queries_total"))]] },
    { title: "Prompt tokens: computed / cached", unit: "tokens/s", series: [
      ["computed", (s) => s.rate("prompt_tokens_by_source_total", { source: "local_compute" })],
      ["cached", (s) => s.rate("prompt_tokens_cached_total")]] },
    { title: "Preemptions", unit: "per s", series: [
      ["preemptions", (s) => s.rate("num_preemptions_total")]] },
    { title: "Speculative decoding acceptance rate", unit: "%", series: [
      ["accepted / drafted", (s) => pct(s.ratio("spec_decode_num_accepted_tokens_total",
                                                "spec_decode_num_draft_tokens_total"))]] },
    { title: "Generation tokens per request: asked / produced", unit: "tokens", series: [
      ["max_tokens p50", (s) => s.quantile("request_params_max_tokens", 0.5)],
      ["max_tokens p99", (s) => s.quantile("request_params_max_tokens", 0.99)],
      ["produced p50", (s) => s.quantile("request_max_num_generation_tokens", 0.5)],
      ["produced p99", (s) => s.quantile("request_max_num_generation_tokens", 0.99)]] },
    { title: "Finished requests by reason", unit: "req/s", series: ["stop", "length", "abort",
      "error"].map((r) => [r, (s) => s.rate("request_success_total", { finished_reason: r })]) },
    { title: "Engine restarts", unit: "restarts", series: [
      ["restarts", (s) => s.value("engine_restarts_total")]] },
    { title: "GPU memory", unit: "GiB", gpu: true, series: [
      ["used", (s) => gib(s.value("gpu_memory_used_bytes"))],
      ["total", (s) => gib(s.value("gpu_memory_total_bytes"))]] },
  ];
  const last = (a) => { for (let i = a.length - 1; i >= 0; i--) if (a[i] != null) return a[i]; return null; };
  const gib = (v) => (v == null ? null : v / 2 ** 30);

  // --- the Prometheus text format: name{labels} value -----------------------------------
  function parse(text) {
    const out = new Map();
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
      if (!m) continue;
      const labels = {};
      if (m[3]) for (const l of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g))
        labels[l[1]] = l[2];
      const name = m[1].replace(/^pagoda:/, "");
      if (!out.has(name)) out.set(name, []);
      out.get(name).push({ labels, value: parseFloat(m[4]) });
    }
    return out;
  }

  function sum(snap, name, match) {
    const rows = snap.m.get(name);
    if (!rows) return null;
    let total = 0, any = false;
    for (const r of rows) {
      if (match && !Object.entries(match).every(([k, v]) => r.labels[k] === v)) continue;
      total += r.value; any = true;
    }
    return any ? total : null;
  }

  const history = []; // snapshots {t: seconds, m: parsed metrics}, oldest first

  function ago(seconds) {
    const now = history[history.length - 1];
    for (let i = history.length - 2; i >= 0; i--)
      if (now.t - history[i].t >= seconds) return history[i];
    return history.length > 1 ? history[0] : null;
  }

  // What the panels' functions see: the newest snapshot against older ones.
  const view = {
    value: (name, match) => sum(history[history.length - 1], name, match),
    rate(name, match) {
      const now = history[history.length - 1], then = ago(RATE_WINDOW_S);
      if (!then) return null;
      const a = sum(then, name, match), b = sum(now, name, match);
      return a == null || b == null ? null : Math.max(b - a, 0) / (now.t - then.t);
    },
    ratio(num, den) {
      const now = history[history.length - 1], then = ago(QUANTILE_WINDOW_S);
      if (!then) return null;
      const d = sum(now, den) - sum(then, den);
      return d > 0 ? (sum(now, num) - sum(then, num)) / d : null;
    },
    quantile(name, p) {
      // histogram_quantile over the window: bucket deltas, linear within the bucket.
      const now = history[history.length - 1], then = ago(QUANTILE_WINDOW_S);
      if (!then) return null;
      const buckets = new Map();
      for (const [snap, sign] of [[now, 1], [then, -1]])
        for (const r of snap.m.get(name + "_bucket") || [])
          buckets.set(r.labels.le, (buckets.get(r.labels.le) || 0) + sign * r.value);
      const les = [...buckets.keys()].sort((a, b) => parseFloat(a) - parseFloat(b));
      const total = buckets.get("+Inf") || 0;
      if (total <= 0) return null;
      const rank = p * total;
      let prevLe = 0, prevCount = 0;
      for (const le of les) {
        const count = buckets.get(le), upper = parseFloat(le);
        if (count >= rank) {
          if (!isFinite(upper)) return prevLe;
          return prevLe + (upper - prevLe) * ((rank - prevCount) / Math.max(count - prevCount, 1e-9));
        }
        prevLe = upper; prevCount = count;
      }
      return prevLe;
    },
  };

  // --- the charts -------------------------------------------------------------------------
  const grid = document.getElementById("panels");
  const charts = [];
  const fmt = (v) => (v == null ? "–" : Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(v >= 10 ? 1 : 2));

  for (const panel of PANELS) {
    const card = document.createElement("section");
    card.className = "card";
    card.innerHTML = `<h2>${panel.title} <span class="unit">${panel.unit}</span></h2>`;
    const box = document.createElement("div");
    card.appendChild(box);
    const note = document.createElement("p");
    note.className = "note";
    card.appendChild(note);
    grid.appendChild(card);
    const data = [[], ...panel.series.map(() => [])];
    const opts = {
      width: box.clientWidth || 400, height: 190,
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
      axes: [{ stroke: "#555", grid: { stroke: "#eee" } },
             { stroke: "#555", grid: { stroke: "#eee" }, size: 55, values: (u, vs) => vs.map(fmt) }],
      series: [{}, ...panel.series.map(([label], i) => ({
        label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false,
        // At the cursor, or the latest value when the cursor is off the chart.
        value: (u, v, si, idx) => fmt(idx == null ? last(u.data[si]) : v),
      }))],
    };
    const chart = new uPlot(opts, data, box);
    charts.push({ panel, chart, data, box, note });
  }

  function resize() {
    for (const c of charts) c.chart.setSize({ width: c.box.clientWidth, height: 190 });
  }
  window.addEventListener("resize", resize);

  // --- polling ----------------------------------------------------------------------------
  const status = document.getElementById("status");
  const model = document.getElementById("model");
  const state = { polls: 0, failures: 0 };

  async function poll() {
    try {
      const r = await fetch("metrics", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const t = Date.now() / 1000;
      history.push({ t, m: parse(await r.text()) });
      while (history.length > 2 && t - history[1].t > Math.max(RATE_WINDOW_S, QUANTILE_WINDOW_S) + 5)
        history.shift();
      const running = history[history.length - 1].m.get("num_requests_running");
      if (running && running[0]) model.textContent = running[0].labels.model_name || "";
      for (const c of charts) {
        c.data[0].push(t);
        c.panel.series.forEach(([, f], i) => c.data[i + 1].push(f(view)));
        while (c.data[0].length && t - c.data[0][0] > WINDOW_S) c.data.forEach((a) => a.shift());
        c.chart.setData(c.data);
        const none = c.panel.series.every((_, i) => c.data[i + 1].every((v) => v == null));
        c.note.textContent = none ? (c.panel.gpu ? "no GPU on this server" : "no data yet") : "";
      }
      state.polls++;
      status.textContent = `updated ${new Date().toLocaleTimeString()}`;
      status.className = "ok";
    } catch (e) {
      state.failures++;
      status.textContent = `cannot reach /metrics (${e.message}); retrying`;
      status.className = "bad";
    }
  }
  poll();
  setInterval(poll, POLL_MS);

  // For tests and the curious: which panels have drawn a non-zero value.
  window.pagodaDashboard = {
    state, charts,
    nonZero: () => Object.fromEntries(charts.map((c) => [c.panel.title,
      c.data.slice(1).some((s) => s.some((v) => v != null && v > 0))])),
  };
})();
