// Block pool on one canvas, at any size. A pool with more blocks than the canvas has cells is an
// overview: one cell per bucket of blocks, coloured by the bucket's highest state (shared >
// used > cached > free) with its share of non-free blocks as the intensity, so a single used
// block in a bucket shows. Drag to zoom into a range (a click on an overview cell zooms to
// single blocks around it); "live only" shows just the used and cached blocks, compacted.
// Synced state: `num_blocks`, `block_size`, `delta` / `delta_base` / `version` (the blocks
// changed since version `delta_base`, see kvscope/widgets/pool_sync.py), `table_ids` / `tables` (the
// block tables, `kvsDecodeTables`; a linked block-tables view reads them here too), `selected_request`,
// `selected_block`, `step`, `max_height`, `details` (block id -> hover facts, static export only);
// live hover facts come through an "inspect" message.

function kvsRgba(hex) {
  const n = parseInt(hex.slice(1), 16);
  // ImageData is RGBA in memory; a little-endian Uint32 view reads it as ABGR.
  return (0xff << 24 | (n & 0xff) << 16 | (n >> 8 & 0xff) << 8 | n >> 16) >>> 0;
}

/** `a` blended towards `b` by `t` in [0, 1] (both ABGR words). */
function kvsMix(a, b, t) {
  let out = 0xff000000;
  for (const shift of [0, 8, 16]) {
    const x = (a >> shift) & 0xff, y = (b >> shift) & 0xff;
    out |= Math.round(x + (y - x) * t) << shift;
  }
  return out >>> 0;
}

const POOL_RGBA = {
  free: kvsRgba(KVS_COLORS.free),
  cached: kvsRgba(KVS_COLORS.cached),
  used: KVS_COLORS.used.map(kvsRgba),
  selected: kvsRgba(KVS_COLORS.selected),
  picked: kvsRgba(KVS_COLORS.picked),
};
// Bucket codes, highest wins: 0 free, 1 cached, 2 used, 3 shared (ref > 1).
const BUCKET_RGBA = [POOL_RGBA.free, POOL_RGBA.cached, POOL_RGBA.used[0], POOL_RGBA.used[2]];
const MIN_CELL = 2;   // px: more blocks than cells of this size are drawn in buckets
const ZOOM_CELL = 10; // px: a click on an overview cell zooms to blocks this large

/** Cell size and columns that fit `n` cells into `width` x about `maxHeight` pixels. */
function poolGeometry(n, width, maxHeight) {
  const cell = Math.max(MIN_CELL, Math.min(28, Math.floor(Math.sqrt((width * maxHeight) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(n / cols), gap: cell >= 6 ? 1 : 0 };
}

/** Blocks per cell and the cell layout for `count` blocks in `width` x `maxHeight`. */
function poolLayout(count, width, maxHeight) {
  const maxCells = Math.floor(width / MIN_CELL) * Math.floor(maxHeight / MIN_CELL);
  const bucket = Math.max(1, Math.ceil(count / maxCells));
  const cells = Math.ceil(count / bucket);
  return { bucket, cells, ...poolGeometry(cells, width, maxHeight) };
}

/** Per cell of `count` blocks from position `lo` (block `ids[p]`, or block `p` without `ids`),
 * `bucket` blocks a cell: the highest code (0 free, 1 cached, 2 used, 3 shared) and how many
 * blocks are not free. tests/test_widgets.py and test_browser.py check it against numpy. */
function poolBuckets(state, refs, ids, lo, count, bucket) {
  const cells = Math.ceil(count / bucket);
  const top = new Uint8Array(cells), busy = new Uint32Array(cells);
  for (let k = 0; k < count; k++) {
    const b = ids ? ids[lo + k] : lo + k;
    const s = state[b];
    if (s === 0) continue;
    const code = s === 2 ? 1 : refs[b] > 1 ? 3 : 2;
    const c = (k / bucket) | 0;
    busy[c]++;
    if (code > top[c]) top[c] = code;
  }
  return { top, busy };
}

// The browser's copy of the pool, one per model (all views of a widget share it).
const POOL_STORES = new WeakMap();

function poolStore(model) {
  let s = POOL_STORES.get(model);
  if (!s) POOL_STORES.set(model, s = { version: null, state: new Uint8Array(0), refs: new Int32Array(0), live: null, counts: null });
  return s;
}

/** Apply the model's current update; false when it does not follow the version held. */
function poolApply(model) {
  const s = poolStore(model);
  const version = model.get("version"), base = model.get("delta_base"), n = model.get("num_blocks") || 0;
  if (version === s.version) return true;
  if (base === -1) {
    if (s.state.length !== n) { s.state = new Uint8Array(n); s.refs = new Int32Array(n); }
    else { s.state.fill(0); s.refs.fill(0); }
  } else if (base !== s.version || s.state.length !== n) return false;
  const d = kvsDecodeDelta(kvsBuffer(model.get("delta")));
  for (let i = 0; i < d.ids.length; i++) { s.state[d.ids[i]] = d.states[i]; s.refs[d.ids[i]] = d.refs[i]; }
  Object.assign(s, { version, live: null, counts: null });
  return true;
}

/** The used and cached blocks, ascending (the "live only" view). */
function poolLive(s) {
  if (!s.live) {
    let m = 0;
    for (let b = 0; b < s.state.length; b++) if (s.state[b] !== 0) m++;
    s.live = new Int32Array(m);
    for (let b = 0, i = 0; b < s.state.length; b++) if (s.state[b] !== 0) s.live[i++] = b;
  }
  return s.live;
}

function poolCounts(s) {
  if (!s.counts) {
    const c = { free: 0, used: 0, cached: 0, shared: 0 };
    for (let b = 0; b < s.state.length; b++) {
      const st = s.state[b];
      if (st === 1) { c.used++; if (s.refs[b] > 1) c.shared++; } else if (st === 2) c.cached++; else c.free++;
    }
    s.counts = c;
  }
  return s.counts;
}

/** Position of block `b` in the sorted `ids`, or -1. */
function kvsIndexOf(ids, b) {
  let lo = 0, hi = ids.length;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (ids[mid] < b) lo = mid + 1; else hi = mid; }
  return lo < ids.length && ids[lo] === b ? lo : -1;
}

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-pool");
  el.dataset.kvscopeView = "pool";
  const legend = h("div", { class: "kvs-legend" });
  const scale = h("span", { class: "kvs-dim kvs-scale" });
  const live = h("input", { type: "checkbox", class: "kvs-live-only" });
  const controls = h("div", { class: "kvs-legend kvs-pool-controls" },
    h("label", { title: "show only the used and cached blocks, side by side" }, live, " live only"),
    h("button", { class: "kvs-zoom-live", title: "show the range from the first to the last used or cached block" }, "zoom to live"),
    h("button", { class: "kvs-zoom-out", title: "show 8\u00d7 more blocks" }, "zoom out"),
    h("button", { class: "kvs-zoom-reset", title: "show the whole pool" }, "whole pool"),
    scale);
  const canvas = h("canvas", { class: "kvs-pool-canvas" });
  const tip = h("div", { class: "kvs-tip", style: { display: "none" } });
  const brush = h("div", { class: "kvs-brush", style: { display: "none" } });
  const wrap = h("div", { class: "kvs-pool-wrap" }, canvas, brush, tip);
  el.append(legend, controls, wrap);
  const ctx = canvas.getContext("2d");
  const fetched = new Map(); // `${step}:${block}` -> details from the kernel
  const dropped = new Set(); // steps the kernel's trace no longer holds (a live ring buffer dropped them)
  let owners = new Map(), tables = new Map(), geo = null, view = null; // view: positions [lo, hi) shown, of a pool of n blocks
  let draws = 0, hoverBlock = -1, inspectTimer = null, lastEvent = null, lastWidth = 0, drag = null;
  let overview = null; // the last bucket summary drawn (tests read it through el.kvsOverview)

  const store = () => poolStore(model);
  const positions = () => (live.checked ? poolLive(store()) : null);
  const total = () => { const ids = positions(); return ids ? ids.length : store().state.length; };
  const blockAt = (p) => { const ids = positions(); return ids ? ids[p] : p; };

  function load() {
    if (!poolApply(model)) {
      const s = store();
      if (s.resyncAsked !== model.get("version")) { // ask once per update that did not fit
        s.resyncAsked = model.get("version");
        model.send({ type: "resync" });
      }
    }
    owners = new Map();
    tables = new Map();
    for (const { id: rid, blocks } of kvsDecodeTables(model.get("table_ids"), model.get("tables"))) {
      tables.set(rid, blocks);
      for (const b of blocks) {
        if (!owners.has(b)) owners.set(b, []);
        owners.get(b).push(rid);
      }
    }
  }

  function colorOf(b, selected, picked) {
    const s = store();
    if (b === picked) return POOL_RGBA.picked;
    if (selected.has(b)) return POOL_RGBA.selected;
    if (s.state[b] === 1) return POOL_RGBA.used[Math.min(Math.max(s.refs[b], 1), 5) - 1];
    return s.state[b] === 2 ? POOL_RGBA.cached : POOL_RGBA.free;
  }

  function draw() {
    const t0 = performance.now();
    const s = store(), ids = positions(), n = s.state.length, all = total();
    if (!view || view.n !== n || view.hi > all) view = { lo: 0, hi: all, n };
    const { lo, hi } = view, count = hi - lo;
    const width = Math.max(200, (el.clientWidth || 800) - 4);
    geo = { ...poolLayout(count, width, model.get("max_height") || 360), lo, hi };
    const { cell, cols, rows, gap, bucket, cells } = geo;
    canvas.width = cols * cell;
    canvas.height = Math.max(rows * cell, 1);
    const img = ctx.createImageData(canvas.width, canvas.height);
    const px = new Uint32Array(img.data.buffer);
    const selBlocks = Array.from(tables.get(model.get("selected_request")) || []);
    const sel = new Set(selBlocks);
    const picked = model.get("selected_block");
    const inner = cell - gap;
    const fill = (k, c) => {
      const x0 = (k % cols) * cell, y0 = Math.floor(k / cols) * cell;
      for (let y = 0; y < inner; y++) px.fill(c, (y0 + y) * canvas.width + x0, (y0 + y) * canvas.width + x0 + inner);
    };
    if (bucket === 1) {
      overview = null;
      for (let k = 0; k < cells; k++) fill(k, colorOf(blockAt(lo + k), sel, picked));
    } else {
      const { top, busy } = poolBuckets(s.state, s.refs, ids, lo, count, bucket);
      overview = { bucket, lo, count, compact: !!ids, cell, cols, top, busy };
      const mark = new Uint8Array(cells); // 1: holds a selected block, 2: the picked block
      for (const [b, v] of [...selBlocks.map((b) => [b, 1]), [picked, 2]]) {
        const p = ids ? kvsIndexOf(ids, b) : b;
        if (b >= 0 && p >= lo && p < hi) mark[((p - lo) / bucket) | 0] = Math.max(mark[((p - lo) / bucket) | 0], v);
      }
      for (let k = 0; k < cells; k++) {
        const c = top[k];
        const size = Math.min(bucket, count - k * bucket);
        fill(k, mark[k] === 2 ? POOL_RGBA.picked : mark[k] ? POOL_RGBA.selected
          : c === 0 ? POOL_RGBA.free : kvsMix(POOL_RGBA.free, BUCKET_RGBA[c], 0.6 + 0.4 * busy[k] / size));
      }
    }
    ctx.putImageData(img, 0, 0);
    if (cell >= 20) { // big cells (small pools) also show each block's id
      ctx.font = `${Math.floor(cell / 2.6)}px ui-monospace, monospace`;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      for (let k = 0; k < cells; k++) {
        const b = blockAt(lo + k);
        const dark = b === picked || sel.has(b) || (s.state[b] === 1 && s.refs[b] > 1);
        ctx.fillStyle = dark ? "#fff" : "#0008";
        ctx.fillText(String(b), (k % cols) * cell + inner / 2, Math.floor(k / cols) * cell + inner / 2 + 1);
      }
    }
    draws++;
    const counts = poolCounts(s);
    Object.assign(el.dataset, {
      numBlocks: n, step: model.get("step"), free: counts.free, used: counts.used,
      cached: counts.cached, shared: counts.shared, selectedRequest: model.get("selected_request"),
      selectedBlocks: sel.size, draws, drawMs: (performance.now() - t0).toFixed(1), version: s.version,
      bucket, cells, cell, cols, viewLo: lo, viewHi: hi, liveOnly: ids ? "1" : "0",
    });
    const swatch = (color, label) => h("span", { class: "kvs-key" },
      h("i", { style: { background: color } }), label);
    legend.replaceChildren(
      h("b", {}, `step ${model.get("step")}`),
      swatch(KVS_COLORS.free, `free ${counts.free}`),
      swatch(KVS_COLORS.cached, `cached ${counts.cached}`),
      swatch(KVS_COLORS.used[0], `used ${counts.used}`),
      swatch(KVS_COLORS.used[2], `shared (ref>1) ${counts.shared}`),
      model.get("selected_request")
        ? swatch(KVS_COLORS.selected, `request ${model.get("selected_request")}: ${sel.size} blocks`)
        : h("span", { class: "kvs-dim" }, "click a block or a request to select it"),
    );
    const what = ids ? `live blocks ${lo}\u2013${hi - 1} of ${all} (used and cached only)`
      : count === n ? `all ${n} blocks` : `blocks ${lo}\u2013${hi - 1} of ${n}`;
    const held = poolLive(s); // where the used and cached blocks are, for a pool that is mostly free
    scale.textContent = `${what} \u00d7 ${model.get("block_size")} tokens \u00b7 ` + (bucket > 1
      ? `1 cell = ${bucket} blocks (its highest state; paler = fewer of them in use) \u00b7 drag or click to zoom`
      : "1 cell = 1 block") + (held.length ? ` \u00b7 used and cached blocks lie in ${held[0]}\u2013${held[held.length - 1]}` : "");
  }

  /** The cell under a mouse event, or -1. */
  function cellAt(ev) {
    if (!geo) return -1;
    const r = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / geo.cell), row = Math.floor((ev.clientY - r.top) / geo.cell);
    const k = row * geo.cols + col;
    return col >= 0 && col < geo.cols && k >= 0 && k < geo.cells ? k : -1;
  }

  /** Positions [lo, hi) that cell `k` stands for. */
  function cellRange(k) {
    const lo = geo.lo + k * geo.bucket;
    return [lo, Math.min(lo + geo.bucket, geo.hi)];
  }

  function detailsOf(b) {
    return (model.get("details") || {})[b] || fetched.get(`${model.get("step")}:${b}`);
  }

  function place(ev) {
    const r = wrap.getBoundingClientRect();
    Object.assign(tip.style, {
      display: "block", left: `${Math.min(ev.clientX - r.left + 12, r.width - 260)}px`,
      top: `${ev.clientY - r.top + 12}px`,
    });
  }

  function showBucketTip(k, ev) {
    const s = store(), [a, b] = cellRange(k);
    const c = { used: 0, cached: 0, shared: 0 };
    for (let p = a; p < b; p++) {
      const blk = blockAt(p), st = s.state[blk];
      if (st === 1) { c.used++; if (s.refs[blk] > 1) c.shared++; } else if (st === 2) c.cached++;
    }
    tip.replaceChildren(h("b", {}, `blocks ${blockAt(a)}\u2013${blockAt(b - 1)}`), ` \u00b7 ${b - a} blocks`,
      h("br"), `used ${c.used} \u00b7 shared ${c.shared} \u00b7 cached ${c.cached} \u00b7 free ${b - a - c.used - c.cached}`,
      h("br"), h("span", { class: "kvs-dim" }, "click to zoom to single blocks here, or drag a range"));
    place(ev);
  }

  function showTip(b, ev) {
    if (b < 0) { tip.style.display = "none"; return; }
    const s = store(), names = ["free", "used", "cached"];
    const d = detailsOf(b);
    const who = d ? d.owners : owners.get(b) || [];
    const lines = [
      h("b", {}, `block ${b}`), ` \u00b7 ${names[s.state[b]]} \u00b7 ref ${s.refs[b]}`,
      h("br"), `owners: ${who.length ? who.join(", ") : "none"}`,
    ];
    if (d) {
      lines.push(h("br"), `hash: ${d.hash === null ? "none" : d.hash}`,
        h("br"), `tokens (${d.tokens.length}): ${d.tokens.join(" ")}`,
        h("br"), h("code", {}, kvsShowText(d.text)));
    } else if (s.state[b] !== 0) {
      const step = model.get("step");
      lines.push(h("br"), h("span", { class: "kvs-dim" }, dropped.has(step)
        ? `tokens: step ${step} is no longer held by the trace (its ring buffer dropped it)`
        : "tokens: asking the kernel\u2026"));
    }
    tip.replaceChildren(...lines);
    place(ev);
  }

  function showBrush(a, b) {
    const [k0, k1] = [Math.min(a, b), Math.max(a, b)];
    const y0 = Math.floor(k0 / geo.cols) * geo.cell, y1 = (Math.floor(k1 / geo.cols) + 1) * geo.cell;
    const [first] = cellRange(k0), [, last] = cellRange(k1);
    Object.assign(brush.style, { display: "block", top: `${y0}px`, height: `${y1 - y0}px`, width: `${canvas.width}px` });
    brush.textContent = `zoom to ${last - first} blocks`;
  }

  function onMove(ev) {
    const k = cellAt(ev);
    lastEvent = ev;
    if (drag && k >= 0 && k !== drag.from) { drag.to = k; showBrush(drag.from, k); }
    clearTimeout(inspectTimer);
    if (k < 0) { hoverBlock = -1; tip.style.display = "none"; return; }
    if (geo.bucket > 1) { hoverBlock = -1; showBucketTip(k, ev); return; }
    const b = blockAt(geo.lo + k);
    hoverBlock = b;
    showTip(b, ev);
    if (store().state[b] !== 0 && !detailsOf(b) && !dropped.has(model.get("step"))) {
      inspectTimer = setTimeout(() => model.send({ type: "inspect", step: model.get("step"), blocks: [b] }), 60);
    }
  }

  /** Show positions [lo, hi) (clamped to the blocks there are). */
  function zoomTo(lo, hi) {
    const all = total();
    const size = Math.max(1, Math.min(all, hi - lo));
    lo = Math.max(0, Math.min(Math.round(lo), all - size));
    view = { lo, hi: lo + size, n: store().state.length };
    tip.style.display = "none";
    draw();
  }

  function select(k) {
    const b = blockAt(geo.lo + k);
    const who = owners.get(b) || [];
    const cur = model.get("selected_request");
    // Clicking a shared block again cycles through its owners.
    const next = who.length ? who[(who.indexOf(cur) + 1) % who.length] : "";
    model.set("selected_block", who.length ? b : -1);
    model.set("selected_request", next);
    model.save_changes();
  }

  function onDown(ev) {
    const k = cellAt(ev);
    if (k >= 0) drag = { from: k, to: k };
  }

  function onUp(ev) {
    const d = drag;
    drag = null;
    brush.style.display = "none";
    if (!d) return;
    if (d.to !== d.from) { // a range: zoom to it
      const [lo] = cellRange(Math.min(d.from, d.to)), [, hi] = cellRange(Math.max(d.from, d.to));
      zoomTo(lo, hi);
    } else if (geo.bucket > 1) { // an overview cell: single blocks around it
      const width = canvas.width, height = model.get("max_height") || 360;
      const span = Math.floor(width / ZOOM_CELL) * Math.floor(height / ZOOM_CELL);
      const [a, b] = cellRange(d.from);
      zoomTo((a + b) / 2 - span / 2, (a + b) / 2 + span / 2);
    } else {
      select(d.from);
    }
    if (lastEvent) onMove(lastEvent);
  }

  function onMsg(msg) {
    if (msg.type !== "details") return;
    if (msg.held === false) dropped.add(msg.step);
    for (const [b, d] of Object.entries(msg.blocks)) fetched.set(`${msg.step}:${b}`, d);
    if (hoverBlock >= 0 && lastEvent) showTip(hoverBlock, lastEvent);
  }

  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("mouseleave", () => { hoverBlock = -1; tip.style.display = "none"; });
  canvas.addEventListener("mousedown", onDown);
  window.addEventListener("mouseup", onUp);
  live.addEventListener("change", () => { view = null; draw(); });
  controls.querySelector(".kvs-zoom-reset").addEventListener("click", () => { view = null; draw(); });
  controls.querySelector(".kvs-zoom-live").addEventListener("click", () => {
    const ids = poolLive(store());
    if (!ids.length) return;
    if (live.checked) zoomTo(0, ids.length);
    else zoomTo(ids[0], ids[ids.length - 1] + 1);
  });
  controls.querySelector(".kvs-zoom-out").addEventListener("click", () => {
    const mid = (view.lo + view.hi) / 2, size = 8 * (view.hi - view.lo);
    zoomTo(mid - size / 2, mid + size / 2);
  });
  el.kvsOverview = () => overview && { ...overview, top: Array.from(overview.top), busy: Array.from(overview.busy) };
  el.kvsZoom = zoomTo;
  model.on("msg:custom", onMsg);
  const unwatch = kvsWatchBatched(model, ["version", "table_ids", "tables", "selected_request", "selected_block", "step", "max_height"],
    () => { load(); draw(); });
  const resize = new ResizeObserver(() => {
    if (el.clientWidth !== lastWidth) { lastWidth = el.clientWidth; draw(); }
  });
  resize.observe(el);
  return () => { unwatch(); resize.disconnect(); model.off("msg:custom", onMsg); window.removeEventListener("mouseup", onUp); };
}

export default { render };
