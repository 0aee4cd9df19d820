// Scheduler queues after one step: running and waiting (head first), requests preempted and
// finished in the step, the token budget spent (prefill / decode) and a KV usage gauge. A lane
// scrolls within a few lines and draws its first MAX_LANE chips (a GPU runs hundreds of
// requests and queues thousands), plus the selected request wherever it stands.
// Synced state: `queues` (see kvscope/widgets/snapshot.py: queues_state), `selected_request`, `step`.

const MAX_LANE = 256;
const LANES = ["running", "waiting", "preempted", "finished"];

/** A lane's chips: the first MAX_LANE requests, the selected one if it stands further back,
 * and how many are not drawn. */
function laneChips(model, ids, cls) {
  const selected = model.get("selected_request");
  const shown = ids.slice(0, MAX_LANE);
  if (ids.length > MAX_LANE && selected && ids.indexOf(selected, MAX_LANE) >= 0) shown.push(selected);
  const chips = shown.map((id) => kvsChip(model, id, cls));
  if (ids.length > shown.length) chips.push(h("span", { class: "kvs-dim" }, ` +${ids.length - shown.length} more`));
  return chips;
}

function kvsGauge(frac, label) {
  const a = Math.PI * (1 - Math.min(Math.max(frac, 0), 1));
  const x = 50 + 40 * Math.cos(a), y = 50 - 40 * Math.sin(a);
  const svg = `<svg viewBox="0 0 100 60" width="120" height="72">
    <path d="M10 50 A40 40 0 0 1 90 50" fill="none" stroke="${KVS_COLORS.free}" stroke-width="10"/>
    <path d="M10 50 A40 40 0 0 1 ${x.toFixed(2)} ${y.toFixed(2)}" fill="none" stroke="${frac > 0.9 ? KVS_COLORS.selected : KVS_COLORS.used[2]}" stroke-width="10"/>
    <text x="50" y="48" text-anchor="middle" font-size="16" fill="currentColor">${(100 * frac).toFixed(0)}%</text></svg>`;
  const box = h("div", { class: "kvs-gauge" }, h("div", { class: "kvs-dim" }, label));
  box.insertAdjacentHTML("beforeend", svg);
  return box;
}

// One line per tensor-parallel rank: the KV heads its shard of every block holds, and its bytes.
function kvsShards(shards) {
  if (shards.length < 2) return h("div", { class: "kvs-dim" }, shards.length ?
    `KV pool: ${shards[0].num_kv_heads} KV heads, ${(shards[0].bytes / 2 ** 20).toFixed(1)} MiB` : "");
  return h("div", { class: "kvs-shards", "data-ranks": shards.length },
    h("div", { class: "kvs-dim" }, `KV shards over ${shards.length} tensor-parallel ranks`),
    shards.map((s) => h("div", { class: "kvs-dim" },
      `rank ${s.rank}: KV heads ${s.kv_head_start}\u2013${s.kv_head_end - 1} of every block, ` +
      `${s.num_blocks} blocks, ${(s.bytes / 2 ** 20).toFixed(1)} MiB`)));
}

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-queues");
  el.dataset.kvscopeView = "queues";

  function draw() {
    const t0 = performance.now();
    const q = model.get("queues") || {};
    const lane = (name, ids, cls) => h("div", { class: "kvs-lane" },
      h("span", { class: "kvs-lane-name" }, `${name} (${(ids || []).length})`),
      h("div", { class: "kvs-lane-chips" }, laneChips(model, ids || [], cls)));
    const budget = Math.max(q.token_budget || 0, 1);
    const pct = (n) => `${(100 * (n || 0) / budget).toFixed(1)}%`;
    el.replaceChildren(
      h("div", { class: "kvs-title" }, `Scheduler \u00b7 step ${model.get("step")}`),
      h("div", { class: "kvs-row" },
        kvsGauge(q.kv_usage || 0, `KV ${q.used || 0}/${q.num_blocks || 0} blocks`),
        h("div", { class: "kvs-grow" },
          h("div", { class: "kvs-dim" }, `token budget: ${q.scheduled_tokens || 0} / ${q.token_budget || 0} ` +
            `(prefill ${q.prefill_tokens || 0}, decode ${q.decode_tokens || 0})`),
          h("div", { class: "kvs-bar" },
            h("span", { class: "kvs-prefill", style: { width: pct(q.prefill_tokens) } }),
            h("span", { class: "kvs-decode", style: { width: pct(q.decode_tokens) } })),
          lane("running", q.running, "kvs-running"),
          lane("waiting", q.waiting, "kvs-waiting"),
          lane("preempted this step", q.preempted, "kvs-preempted"),
          lane("finished this step", q.finished, "kvs-finished"))),
      kvsShards(q.kv_shards || []),
    );
    Object.assign(el.dataset, {
      step: model.get("step"), running: (q.running || []).length, waiting: (q.waiting || []).length,
      preempted: (q.preempted || []).length, drawMs: (performance.now() - t0).toFixed(1),
    });
  }

  function select() { // a request in a lane but past its first chips needs the lanes redrawn
    const rid = model.get("selected_request"), q = model.get("queues") || {};
    const queued = LANES.some((name) => (q[name] || []).includes(rid));
    if (queued && !el.querySelector(`[data-rid="${CSS.escape(rid)}"]`)) draw();
    else kvsMarkSelected(el, rid);
  }
  return kvsWatchView(model, el, ["queues", "step"], draw, select);
}

export default { render };
