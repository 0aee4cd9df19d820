// Helpers shared by every kvscope view. Each view's module is this file followed by the
// view's own code, so a view stays one self-contained ES module (anywidget's `_esm`).

const KVS_COLORS = {
  free: "#e9ecef",
  cached: "#8ecae6",
  used: ["#f6bd60", "#c77dff", "#9d4edd", "#7b2cbf", "#5a189a"], // ref 1, 2, 3, 4, 5+
  selected: "#e63946",
  picked: "#111111",
};

/** A copy of a synced binary trait (DataView, ArrayBuffer or typed array) as an ArrayBuffer. */
function kvsBuffer(v) {
  if (!v) return new ArrayBuffer(0);
  if (v instanceof ArrayBuffer) return v;
  return v.buffer.slice(v.byteOffset, v.byteOffset + v.byteLength);
}

/** `h("div", {class: "x", onclick: fn}, child, "text")` -> an element. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** Token text with whitespace made visible, as the tables show it. */
function kvsShowText(s) {
  return String(s).replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u00b7");
}

/** Call `fn` now and whenever any of `names` changes; returns an unsubscribe function. */
function kvsWatch(model, names, fn) {
  const events = names.map((n) => `change:${n}`).join(" ");
  model.on(events, fn);
  fn();
  return () => model.off(events, fn);
}

/** Like `kvsWatch`, but one call for all the traits that one update changes (they change one
 * by one, synchronously, so the call waits for the end of the current task). */
function kvsWatchBatched(model, names, fn) {
  let queued = false;
  return kvsWatch(model, names, () => {
    if (!queued) { queued = true; queueMicrotask(() => { queued = false; fn(); }); }
  });
}

/** Draw on changes of `names` (batched), and on a new `selected_request` only call `select`
 * (by default: re-mark the elements with a `data-rid`). The views are linked, so every click
 * reaches each of them, and rebuilding every view for it took seconds at GPU scale. `draw`
 * marks the selection itself. Returns an unsubscribe function. */
function kvsWatchView(model, el, names, draw, select) {
  const mark = select || (() => kvsMarkSelected(el, model.get("selected_request")));
  const unwatch = kvsWatchBatched(model, names, draw);
  model.on("change:selected_request", mark);
  return () => { unwatch(); model.off("change:selected_request", mark); };
}

/** Mark the elements of `el` that stand for request `selected` (their `data-rid`), unmark the rest. */
function kvsMarkSelected(el, selected) {
  for (const e of el.querySelectorAll("[data-rid]")) e.classList.toggle("kvs-selected", e.dataset.rid === selected);
}

/** Toggle the shared `selected_request` trait (empty string: nothing selected). */
function kvsSelect(model, requestId) {
  const next = model.get("selected_request") === requestId ? "" : requestId;
  model.set("selected_request", next);
  model.save_changes();
}

/** A request's chip: its id, selectable. */
function kvsChip(model, id, cls) {
  const cl = `kvs-chip ${cls} ${id === model.get("selected_request") ? "kvs-selected" : ""}`;
  return h("span", { class: cl, title: `request ${id}`, "data-rid": id, onclick: () => kvsSelect(model, id) }, id);
}

/** A block delta (kvscope/widgets/pool_sync.py): int32 ids | int32 refcounts | uint8 states. */
function kvsDecodeDelta(buf) {
  const n = buf.byteLength / 9;
  return { ids: new Int32Array(buf, 0, n), refs: new Int32Array(buf, 4 * n, n), states: new Uint8Array(buf, 8 * n, n) };
}

/** The delta of `blocks` (a Map: block id -> [state, ref]) that are not free, ids ascending. */
function kvsEncodeDelta(blocks) {
  const ids = [...blocks.keys()].filter((b) => blocks.get(b)[0] !== 0).sort((a, b) => a - b);
  const d = kvsDecodeDelta(new ArrayBuffer(9 * ids.length));
  ids.forEach((b, i) => { d.ids[i] = b; [d.states[i], d.refs[i]] = blocks.get(b); });
  return d.ids.buffer;
}

/** Block tables (kvscope/widgets/snapshot.py `encode_tables`): `ids`, the request ids, and one
 * int32 buffer `lengths | tokens held | physical blocks | their refcounts`. Rows as the block
 * tables view draws them: [{id, blocks, refs, num_tokens}], `blocks` and `refs` views of the buffer. */
function kvsDecodeTables(ids, buf) {
  const a = new Int32Array(kvsBuffer(buf)), n = (ids || []).length, m = (a.length - 2 * n) / 2;
  const rows = [];
  for (let i = 0, at = 2 * n; i < n; at += a[i], i++) {
    rows.push({ id: ids[i], blocks: a.subarray(at, at + a[i]), refs: a.subarray(at + m, at + m + a[i]), num_tokens: a[n + i] });
  }
  return rows;
}
