// An attached vLLM deployment (kvscope.attach): each instance's prefix cache as an icicle of
// block-hash chains, cross-instance overlap, fault counters, and what a hash-only source cannot show.
// Synced state: `forest` (attach_snapshot.forest_state), `overlap` (overlap_state), `faults`
// (faults_state), `unavailable` ({view: reason}), `title`.

const ATTACH_SHADES = ["#8ecae6", "#f6bd60", "#c77dff", "#9d4edd", "#5a189a"]; // held by 1, 2, 3, 4, 5+ instances

function attachForest(inst, tip) {
  const width = 640, height = Math.min(320, Math.max(40, 4 * inst.height));
  const depth = inst.nodes.reduce((m, n) => Math.max(m, n[1] + 1), 1);
  const cw = width / depth, rh = height / Math.max(inst.height, 1);
  const canvas = h("canvas", { class: "kvs-forest-canvas", width, height, "data-nodes": inst.nodes.length });
  const ctx = canvas.getContext("2d");
  for (const [, d, off, size, holders] of inst.nodes) {
    ctx.fillStyle = ATTACH_SHADES[Math.min(holders, ATTACH_SHADES.length) - 1];
    ctx.fillRect(d * cw, off * rh, Math.max(cw - 1, 1), Math.max(size * rh - (rh >= 3 ? 1 : 0), 1));
  }
  canvas.addEventListener("mousemove", (e) => {
    const r = canvas.getBoundingClientRect();
    const x = e.clientX - r.left, y = e.clientY - r.top, d = Math.floor(x / cw), u = y / rh;
    const n = inst.nodes.find((n) => n[1] === d && u >= n[2] && u < n[2] + n[3]);
    if (!n) { tip.style.display = "none"; return; }
    const [hash, depthN, , size, holders, tokens, text] = n;
    tip.replaceChildren(h("div", {},
      h("div", {}, h("b", {}, `block ${hash}`), ` \u00b7 depth ${depthN}`),
      h("div", {}, `${size} block${size === 1 ? "" : "s"} share this prefix \u00b7 held by ${holders} instance${holders === 1 ? "" : "s"}`),
      h("div", { class: "kvs-dim" }, tokens.length ? `tokens: ${tokens.join(" ")}` : "no token ids sent"),
      text ? h("code", {}, kvsShowText(text)) : null));
    Object.assign(tip.style, { display: "block", left: `${x + 12}px`, top: `${y + 12}px` });
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  return canvas;
}

function attachOverlap(ov) {
  const names = ov.instances || [], dup = ov.duplication || {};
  const head = h("tr", {}, h("td", {}), names.map((n) => h("td", { class: "kvs-num" }, n)));
  const rows = names.map((a, i) => h("tr", {}, h("td", { class: "kvs-rid" }, a),
    (ov.matrix[i] || []).map((v) => h("td", { class: "kvs-num" }, String(v)))));
  return h("div", { class: "kvs-overlap", "data-duplicated": dup.duplicated_blocks, "data-unique": dup.unique_blocks },
    h("div", { class: "kvs-title" }, "Cross-instance overlap"),
    h("div", { class: "kvs-dim" }, `${dup.total_blocks || 0} cached blocks over all instances, ` +
      `${dup.unique_blocks || 0} distinct: ${dup.duplicated_blocks || 0} duplicated ` +
      `(${(100 * (dup.duplicated_fraction || 0)).toFixed(1)}%)`),
    h("table", { class: "kvs-table" }, head, rows),
    (ov.shared || []).length ? h("div", { class: "kvs-scroll" },
      h("div", { class: "kvs-dim" }, "deepest prefixes held by several instances"),
      h("table", { class: "kvs-table" }, ov.shared.map(([hash, d, n, who]) =>
        h("tr", {}, h("td", { class: "kvs-num" }, `depth ${d}`), h("td", {}, hash), h("td", { class: "kvs-num" }, `${n}: ${who.join(", ")}`))))) : null);
}

function attachFaults(faults) {
  const rows = faults.map((f) => {
    const bad = Object.entries(f).filter(([k, v]) => k !== "instance" && v > 0);
    return h("div", { class: "kvs-dim", "data-instance": f.instance },
      `${f.instance}: `, bad.length ? bad.map(([k, v]) => `${k} ${v}`).join(", ") : "no faults");
  });
  return h("div", { class: "kvs-faults" }, h("div", { class: "kvs-title" }, "Stream faults"), rows);
}

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-attach");
  el.dataset.kvscopeView = "attach";
  function draw() {
    const forest = model.get("forest") || { instances: [] };
    const tip = h("div", { class: "kvs-tip", style: { display: "none" } });
    const legend = h("div", { class: "kvs-legend" }, "held by",
      ATTACH_SHADES.map((c, i) => h("span", { class: "kvs-key" }, h("i", { style: { background: c } }), i === 4 ? "5+" : String(i + 1))),
      "instances \u00b7 height: blocks sharing the prefix \u00b7 left to right: chain depth");
    const unavailable = Object.entries(model.get("unavailable") || {});
    el.replaceChildren(
      h("div", { class: "kvs-title" }, model.get("title")),
      legend,
      h("div", { class: "kvs-pool-wrap" }, forest.instances.map((inst) => h("div", { class: "kvs-forest", "data-instance": inst.instance },
        h("div", { class: "kvs-dim" }, `${inst.instance} \u00b7 ${inst.num_blocks} cached blocks`),
        attachForest(inst, tip))), tip),
      attachOverlap(model.get("overlap") || {}),
      attachFaults(model.get("faults") || []),
      unavailable.length ? h("div", { class: "kvs-unavailable" },
        h("div", { class: "kvs-title" }, "Not available from a vLLM source"),
        unavailable.map(([view, why]) => h("div", { class: "kvs-dim", "data-view": view }, `${view}: ${why}; vLLM's KV events name blocks by content hash only.`))) : null);
  }
  return kvsWatch(model, ["forest", "overlap", "faults", "unavailable", "title"], draw);
}

export default { render };
