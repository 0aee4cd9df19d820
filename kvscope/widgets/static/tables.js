// Block tables: one row per request, logical block i -> physical block id; blocks shared with
// another request (ref > 1) are marked. A long table (a GPU request holds hundreds of blocks)
// folds each run of consecutive physical blocks into one chip, "logical a–b -> physical x–y",
// as allocation hands out neighbouring blocks. Clicking a row selects the request (the
// dashboard links `selected_request` with the pool, which then highlights that request's blocks).
// Synced state: `table_ids` / `tables` (the block tables, `kvsDecodeTables`), `selected_request`,
// `step`; or `pool`, a reference to the pool view's model (the dashboard's), whose `table_ids` /
// `tables` carry them instead, so the block tables reach the browser once. Linked, the view draws
// a step once the pool holds the same step.

const MAX_CHIPS = 256;
const FOLD_OVER = 24; // blocks: a longer table folds its runs

/** Chips of one table as runs [first logical, first physical, count, shared]: consecutive
 * blocks alike in sharing make one run when `fold`, else every block is its own. */
function tableRuns(blocks, refs, fold) {
  const runs = [];
  for (let i = 0; i < blocks.length; i++) {
    const shared = refs[i] > 1, last = runs[runs.length - 1];
    if (fold && last && last[3] === shared && blocks[i] === last[1] + last[2]) last[2]++;
    else runs.push([i, blocks[i], 1, shared]);
  }
  return runs;
}

function tableChip([i, b, n, shared], refs) {
  const span = (a, z) => (n === 1 ? `${a}` : `${a}\u2013${z}`);
  const ref = n === 1 ? `ref ${refs[i]}` : shared ? "ref > 1" : "ref 1";
  return h("span", {
    class: `kvs-chip ${shared ? "kvs-shared" : ""}`, "data-logical": i, "data-physical": b, "data-count": n,
    title: `logical ${span(i, i + n - 1)} \u2192 physical ${span(b, b + n - 1)} \u00b7 ${ref}${shared ? " (shared)" : ""}`,
  }, h("sub", {}, span(i, i + n - 1)), span(b, b + n - 1));
}

async function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-tables");
  el.dataset.kvscopeView = "tables";
  const ref = model.get("pool");
  const pool = typeof ref === "string" ? await model.widget_manager.get_model(ref.slice("IPY_MODEL_".length)) : ref || null;
  const source = pool || model; // the model whose `table_ids` / `tables` carry the tables

  /** The rows to draw; null while the linked pool's update of this step has not come. */
  function rowsOf() {
    if (pool && pool.get("step") !== model.get("step")) return null;
    return kvsDecodeTables(source.get("table_ids"), source.get("tables"));
  }

  function draw() {
    const t0 = performance.now();
    const rows = rowsOf();
    if (!rows) return;
    const selected = model.get("selected_request");
    const body = rows.map((r) => {
      const runs = tableRuns(r.blocks, r.refs, r.blocks.length > FOLD_OVER);
      const chips = runs.slice(0, MAX_CHIPS).map((run) => tableChip(run, r.refs));
      if (runs.length > MAX_CHIPS) {
        const [i] = runs[MAX_CHIPS];
        chips.push(h("span", { class: "kvs-dim" }, ` +${r.blocks.length - i} more blocks`));
      }
      return h("tr", { class: r.id === selected ? "kvs-selected" : "", "data-rid": r.id, onclick: () => kvsSelect(model, r.id) },
        h("td", { class: "kvs-rid" }, r.id),
        h("td", { class: "kvs-num" }, `${r.num_tokens} tok / ${r.blocks.length} blk`),
        h("td", {}, chips));
    });
    el.replaceChildren(
      h("div", { class: "kvs-title" }, `Block tables \u00b7 step ${model.get("step")}`,
        h("span", { class: "kvs-dim" }, " \u00b7 logical\u2192physical; ",
          h("span", { class: "kvs-chip kvs-shared" }, "shared"), ` = ref > 1; a table of over ${FOLD_OVER} blocks folds runs: a\u2013b`)),
      rows.length
        ? h("div", { class: "kvs-scroll" }, h("table", { class: "kvs-table" }, body))
        : h("div", { class: "kvs-dim" }, "no request holds blocks at this step"),
    );
    Object.assign(el.dataset, { step: model.get("step"), numRequests: rows.length, drawMs: (performance.now() - t0).toFixed(1) });
  }
  function select() { // mark the selected row, and scroll it into the table's box (a click elsewhere chose it)
    kvsMarkSelected(el, model.get("selected_request"));
    const row = el.querySelector("tr.kvs-selected"), box = el.querySelector(".kvs-scroll");
    if (!row || !box) return;
    const top = row.getBoundingClientRect().top - box.getBoundingClientRect().top;
    if (top < 0 || top + row.offsetHeight > box.clientHeight) box.scrollTop += top - 20;
  }
  const unwatch = kvsWatchView(model, el, ["table_ids", "tables", "step"], draw, select);
  if (!pool) return unwatch;
  const unwatchPool = kvsWatchBatched(pool, ["step", "table_ids", "tables"], draw);
  return () => { unwatch(); unwatchPool(); };
}

export default { render };
