// Request lifecycle: one row per request across the recorded steps, coloured by its state in
// each step (waiting, prefill, recompute, decode, preempted, idle) and closed by a finished or
// aborted mark. A prefill's cached prefix is the darker lower band, as wide as its share of the
// prompt. One canvas, no element per cell, so 256 requests x 2,000 steps stay interactive.
// Synced state: `intervals` (int32 rows: request index, state code, start step, end step,
// tokens, cached tokens; see kvscope/widgets/snapshot.py: lifecycle_state), `states` (names of
// the codes), `requests` ([{id, prompt_len, output_len, num_cached_tokens, num_preemptions,
// ttft_s, mean_itl_s, finish_reason}]), `first_step`, `last_step`, `step`, `selected_request`.

const LIFE_COLORS = {
  waiting: "#ced4da", prefill: "#457b9d", recompute: "#e76f51", decode: "#f4a261",
  preempted: "#e63946", idle: "#eef1f4", finished: "#222222", aborted: "#e63946",
};
const LIFE_CACHED = KVS_COLORS.cached;
const CLOSING = ["finished", "aborted"]; // zero-length rows that end a life
const GUTTER = 64; // px for request ids

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-lifecycle");
  el.dataset.kvscopeView = "lifecycle";
  const title = h("div", { class: "kvs-title" });
  const legend = h("div", { class: "kvs-legend" });
  const canvas = h("canvas", { class: "kvs-life-canvas" });
  const tip = h("div", { class: "kvs-tip", style: { display: "none" } });
  const scroller = h("div", { class: "kvs-life-scroll" }, canvas);
  const wrap = h("div", { class: "kvs-pool-wrap" }, scroller, tip);
  el.append(title, legend, wrap);
  const ctx = canvas.getContext("2d");
  let rows = null, geo = null, lastWidth = 0, draws = 0;

  /** Intervals grouped by request row: per row, its interval indices. */
  function load() {
    const buf = kvsBuffer(model.get("intervals"));
    const a = new Int32Array(buf);
    const n = (model.get("requests") || []).length;
    rows = Array.from({ length: n }, () => []);
    for (let i = 0; i < a.length / 6; i++) rows[a[6 * i]].push(i);
    rows.data = a;
  }

  function draw() {
    const t0 = performance.now();
    const reqs = model.get("requests") || [], states = model.get("states") || [];
    const a = rows.data, first = model.get("first_step"), last = model.get("last_step");
    const width = Math.max(300, (el.clientWidth || 800) - 4);
    const n = reqs.length, span = Math.max(1, last - first + 1);
    const rowH = Math.max(4, Math.min(16, Math.floor(360 / Math.max(n, 1))));
    const sx = (width - GUTTER) / span;
    geo = { rowH, sx, first, last, n };
    canvas.width = width;
    canvas.height = Math.max(1, n * rowH);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const selected = model.get("selected_request");
    const x = (step) => GUTTER + (step - first) * sx;
    for (let r = 0; r < n; r++) {
      const y = r * rowH, inner = Math.max(1, rowH - (rowH >= 6 ? 1 : 0));
      if (reqs[r].id === selected) { ctx.fillStyle = "#e6394622"; ctx.fillRect(0, y, width, rowH); }
      for (const i of rows[r]) {
        const state = states[a[6 * i + 1]], start = a[6 * i + 2], end = a[6 * i + 3];
        const tokens = a[6 * i + 4], cached = a[6 * i + 5];
        ctx.fillStyle = LIFE_COLORS[state];
        if (CLOSING.includes(state)) { // the close of a life: a mark at its step's end
          ctx.fillRect(x(end + 1) - 2, y, 2, inner);
          continue;
        }
        const x0 = x(start), w = Math.max(1, x(end + 1) - x0);
        ctx.fillRect(x0, y, w, inner);
        if (cached > 0) { // the cached prefix: its share of what the prefill covered
          ctx.fillStyle = LIFE_CACHED;
          ctx.fillRect(x0, y + Math.ceil(inner / 2), Math.max(1, w * cached / (cached + tokens)), Math.floor(inner / 2));
        }
      }
    }
    if (rowH >= 9) {
      ctx.font = `${Math.min(11, rowH - 2)}px ui-monospace, monospace`;
      ctx.textBaseline = "middle";
      ctx.fillStyle = getComputedStyle(el).color; // the theme's text colour (a dark theme's is light)
      for (let r = 0; r < n; r++) ctx.fillText(reqs[r].id.slice(0, 9), 2, r * rowH + rowH / 2);
    }
    const step = model.get("step");
    ctx.fillStyle = KVS_COLORS.selected;
    ctx.fillRect(x(step + 0.5), 0, 1, canvas.height);
    draws++;
    title.replaceChildren(`Request lifecycle \u00b7 ${n} requests \u00d7 steps ${first}\u2013${last}`,
      h("span", { class: "kvs-dim" }, " \u00b7 hover for a request's metrics, click to select it"));
    legend.replaceChildren(...Object.entries(LIFE_COLORS).filter(([s]) => s !== "aborted").map(([s, c]) =>
      h("span", { class: "kvs-key" }, h("i", { style: { background: c } }), s === "finished" ? "finished | aborted (red)" : s)),
      h("span", { class: "kvs-key" }, h("i", { style: { background: LIFE_CACHED } }), "cached prefix"));
    Object.assign(el.dataset, {
      step, numRequests: n, numIntervals: a.length / 6, rowHeight: rowH, firstStep: first, lastStep: last,
      selectedRequest: selected, draws, drawMs: (performance.now() - t0).toFixed(1),
    });
  }

  /** [row, step] under a mouse event, or null. */
  function cellAt(ev) {
    if (!geo) return null;
    const r = canvas.getBoundingClientRect();
    const row = Math.floor((ev.clientY - r.top) / geo.rowH);
    const step = Math.floor(geo.first + (ev.clientX - r.left - GUTTER) / geo.sx);
    return row >= 0 && row < geo.n ? [row, Math.min(Math.max(step, geo.first), geo.last)] : null;
  }

  function onMove(ev) {
    const at = cellAt(ev);
    if (!at) { tip.style.display = "none"; return; }
    const [row, step] = at, req = model.get("requests")[row], a = rows.data, states = model.get("states");
    const here = rows[row].find((i) => a[6 * i + 2] <= step && step <= a[6 * i + 3] && !CLOSING.includes(states[a[6 * i + 1]]));
    const ms = (v) => (v === null || v === undefined ? "\u2013" : `${(1000 * v).toFixed(1)} ms`);
    const lines = [h("b", {}, `request ${req.id}`), ` \u00b7 step ${step}: `,
      here === undefined ? "not in the engine" : `${states[a[6 * here + 1]]} (steps ${a[6 * here + 2]}\u2013${a[6 * here + 3]}` +
        (a[6 * here + 4] ? `, ${a[6 * here + 4]} tokens` : "") + (a[6 * here + 5] ? `, ${a[6 * here + 5]} cached` : "") + ")",
      h("br"), `TTFT ${ms(req.ttft_s)} \u00b7 ITL ${ms(req.mean_itl_s)}`,
      h("br"), `tokens: prompt ${req.prompt_len}, output ${req.output_len} \u00b7 cached ${req.num_cached_tokens}`,
      h("br"), `preemptions ${req.num_preemptions}` + (req.finish_reason ? ` \u00b7 finished: ${req.finish_reason}` : "")];
    tip.replaceChildren(...lines);
    const r = wrap.getBoundingClientRect();
    Object.assign(tip.style, {
      display: "block", left: `${Math.min(ev.clientX - r.left + 12, r.width - 300)}px`, top: `${ev.clientY - r.top + 12}px`,
    });
  }

  function onClick(ev) {
    const at = cellAt(ev);
    if (at) kvsSelect(model, model.get("requests")[at[0]].id);
  }

  function reveal() { // bring the selected request's row into view
    const i = (model.get("requests") || []).findIndex((q) => q.id === model.get("selected_request"));
    if (i >= 0 && geo) {
      const top = i * geo.rowH;
      if (top < scroller.scrollTop || top + geo.rowH > scroller.scrollTop + scroller.clientHeight) scroller.scrollTop = top - 40;
    }
  }

  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  canvas.addEventListener("click", onClick);
  const unwatch = kvsWatchBatched(model, ["intervals", "requests", "states", "first_step", "last_step", "step", "selected_request"],
    () => { load(); draw(); reveal(); });
  const resize = new ResizeObserver(() => {
    if (el.clientWidth !== lastWidth) { lastWidth = el.clientWidth; if (rows) draw(); }
  });
  resize.observe(el);
  return () => { unwatch(); resize.disconnect(); };
}

export default { render };
