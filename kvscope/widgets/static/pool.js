// Block pool: every physical KV block is one cell of a canvas, so 100k+ blocks draw in a
// few milliseconds. Synced state: `state` (uint8 per block: 0 free, 1 used, 2 cached free),
// `ref_count` (int32 per block), `tables` ({request_id: [physical block ids]}),
// `selected_request`, `selected_block`, `step`, `details` (block id -> hover facts, used by
// the static export); live hover facts come from the kernel through an "inspect" message.

function kvsRgba(hex) {
  const n = parseInt(hex.slice(1), 16);
  // ImageData is RGBA in memory; a little-endian Uint32 view reads it as ABGR.
  return (0xff << 24 | (n & 0xff) << 16 | (n >> 8 & 0xff) << 8 | n >> 16) >>> 0;
}

const POOL_RGBA = {
  free: kvsRgba(KVS_COLORS.free),
  cached: kvsRgba(KVS_COLORS.cached),
  used: KVS_COLORS.used.map(kvsRgba),
  selected: kvsRgba(KVS_COLORS.selected),
  picked: kvsRgba(KVS_COLORS.picked),
};

/** Cell size and columns that fit `n` cells into `width` x about `maxHeight` pixels. */
function poolGeometry(n, width, maxHeight) {
  const cell = Math.max(2, Math.min(28, Math.floor(Math.sqrt((width * maxHeight) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(n / cols), gap: cell >= 6 ? 1 : 0 };
}

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-pool");
  el.dataset.kvscopeView = "pool";
  const legend = h("div", { class: "kvs-legend" });
  const canvas = h("canvas", { class: "kvs-pool-canvas" });
  const tip = h("div", { class: "kvs-tip", style: { display: "none" } });
  const wrap = h("div", { class: "kvs-pool-wrap" }, canvas, tip);
  el.append(legend, wrap);
  const ctx = canvas.getContext("2d");
  const fetched = new Map(); // `${step}:${block}` -> details from the kernel
  let state = new Uint8Array(0), refs = new Int32Array(0), owners = new Map(), geo = null;
  let draws = 0, hoverBlock = -1, inspectTimer = null, lastEvent = null, lastWidth = 0;

  function load() {
    state = new Uint8Array(kvsBuffer(model.get("state")));
    refs = new Int32Array(kvsBuffer(model.get("ref_count")));
    owners = new Map();
    for (const [rid, blocks] of Object.entries(model.get("tables") || {})) {
      for (const b of blocks) {
        if (!owners.has(b)) owners.set(b, []);
        owners.get(b).push(rid);
      }
    }
  }

  function colorOf(b, selected, picked) {
    if (b === picked) return POOL_RGBA.picked;
    if (selected.has(b)) return POOL_RGBA.selected;
    if (state[b] === 1) return POOL_RGBA.used[Math.min(Math.max(refs[b], 1), 5) - 1];
    return state[b] === 2 ? POOL_RGBA.cached : POOL_RGBA.free;
  }

  function draw() {
    const t0 = performance.now();
    const n = state.length;
    const width = Math.max(200, (el.clientWidth || 800) - 4);
    geo = poolGeometry(n, width, model.get("max_height") || 360);
    const { cell, cols, rows, gap } = geo;
    canvas.width = cols * cell;
    canvas.height = Math.max(rows * cell, 1);
    const img = ctx.createImageData(canvas.width, canvas.height);
    const px = new Uint32Array(img.data.buffer);
    const sel = new Set((model.get("tables") || {})[model.get("selected_request")] || []);
    const picked = model.get("selected_block");
    const inner = cell - gap;
    const counts = { free: 0, used: 0, cached: 0, shared: 0 };
    for (let b = 0; b < n; b++) {
      const s = state[b];
      if (s === 1) { counts.used++; if (refs[b] > 1) counts.shared++; }
      else if (s === 2) counts.cached++;
      else counts.free++;
      const c = colorOf(b, sel, picked);
      const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
      for (let y = 0; y < inner; y++) px.fill(c, (y0 + y) * canvas.width + x0, (y0 + y) * canvas.width + x0 + inner);
    }
    ctx.putImageData(img, 0, 0);
    if (cell >= 20) { // big cells (small pools) also show each block's id
      ctx.font = `${Math.floor(cell / 2.6)}px ui-monospace, monospace`;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      for (let b = 0; b < n; b++) {
        const dark = b === picked || sel.has(b) || (state[b] === 1 && refs[b] > 1);
        ctx.fillStyle = dark ? "#fff" : "#0008";
        ctx.fillText(String(b), (b % cols) * cell + inner / 2, Math.floor(b / cols) * cell + inner / 2 + 1);
      }
    }
    draws++;
    Object.assign(el.dataset, {
      numBlocks: n, step: model.get("step"), free: counts.free, used: counts.used,
      cached: counts.cached, shared: counts.shared, selectedRequest: model.get("selected_request"),
      selectedBlocks: sel.size, draws, drawMs: (performance.now() - t0).toFixed(1),
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
      h("span", { class: "kvs-dim" }, (model.get("num_blocks") || n) > n
        ? `first ${n} of ${model.get("num_blocks")} blocks shown \u00d7 ${model.get("block_size")} tokens`
        : `${n} blocks \u00d7 ${model.get("block_size")} tokens`),
    );
  }

  function blockAt(ev) {
    if (!geo) return -1;
    const r = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / geo.cell), row = Math.floor((ev.clientY - r.top) / geo.cell);
    const b = row * geo.cols + col;
    return col >= 0 && col < geo.cols && b >= 0 && b < state.length ? b : -1;
  }

  function detailsOf(b) {
    return (model.get("details") || {})[b] || fetched.get(`${model.get("step")}:${b}`);
  }

  function showTip(b, ev) {
    if (b < 0) { tip.style.display = "none"; return; }
    const names = ["free", "used", "cached"];
    const d = detailsOf(b);
    const who = d ? d.owners : owners.get(b) || [];
    const lines = [
      h("b", {}, `block ${b}`), ` \u00b7 ${names[state[b]]} \u00b7 ref ${refs[b]}`,
      h("br"), `owners: ${who.length ? who.join(", ") : "none"}`,
    ];
    if (d) {
      lines.push(h("br"), `hash: ${d.hash === null ? "none" : d.hash}`,
        h("br"), `tokens (${d.tokens.length}): ${d.tokens.join(" ")}`,
        h("br"), h("code", {}, kvsShowText(d.text)));
    } else if (state[b] !== 0) {
      lines.push(h("br"), h("span", { class: "kvs-dim" }, "tokens: asking the kernel\u2026"));
    }
    tip.replaceChildren(...lines);
    const r = wrap.getBoundingClientRect();
    Object.assign(tip.style, {
      display: "block", left: `${Math.min(ev.clientX - r.left + 12, r.width - 260)}px`,
      top: `${ev.clientY - r.top + 12}px`,
    });
  }

  function onMove(ev) {
    const b = blockAt(ev);
    hoverBlock = b;
    showTip(b, ev);
    clearTimeout(inspectTimer);
    if (b >= 0 && state[b] !== 0 && !detailsOf(b)) {
      inspectTimer = setTimeout(() => model.send({ type: "inspect", step: model.get("step"), blocks: [b] }), 60);
    }
    lastEvent = ev;
  }

  function onClick(ev) {
    const b = blockAt(ev);
    const who = b >= 0 ? owners.get(b) || [] : [];
    const cur = model.get("selected_request");
    // Clicking a shared block again cycles through its owners.
    const next = who.length ? who[(who.indexOf(cur) + 1) % who.length] : "";
    model.set("selected_block", who.length ? b : -1);
    model.set("selected_request", next);
    model.save_changes();
  }

  function onMsg(msg) {
    if (msg.type !== "details") return;
    for (const [b, d] of Object.entries(msg.blocks)) fetched.set(`${msg.step}:${b}`, d);
    if (hoverBlock >= 0 && lastEvent) showTip(hoverBlock, lastEvent);
  }

  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("mouseleave", () => { hoverBlock = -1; tip.style.display = "none"; });
  canvas.addEventListener("click", onClick);
  model.on("msg:custom", onMsg);
  const unwatch = kvsWatch(model, ["state", "ref_count", "tables", "selected_request", "selected_block", "step", "max_height"],
    () => { load(); draw(); });
  const resize = new ResizeObserver(() => {
    if (el.clientWidth !== lastWidth) { lastWidth = el.clientWidth; draw(); }
  });
  resize.observe(el);
  return () => { unwatch(); resize.disconnect(); model.off("msg:custom", onMsg); };
}

export default { render };
