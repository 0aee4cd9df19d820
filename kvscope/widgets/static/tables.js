// Block tables: one row per request, logical block i -> physical block id; blocks shared with
// another request (ref > 1) are marked. Clicking a row selects the request (the dashboard
// links `selected_request` with the pool, which then highlights that request's blocks).
// Synced state: `rows` ([{id, blocks, refs, num_tokens}]), `selected_request`, `step`.

const MAX_CHIPS = 256;

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-tables");
  el.dataset.kvscopeView = "tables";

  function draw() {
    const rows = model.get("rows") || [];
    const selected = model.get("selected_request");
    const body = rows.map((r) => {
      const chips = r.blocks.slice(0, MAX_CHIPS).map((b, i) => {
        const shared = r.refs[i] > 1;
        return h("span", {
          class: `kvs-chip ${shared ? "kvs-shared" : ""}`,
          title: `logical ${i} \u2192 physical ${b} \u00b7 ref ${r.refs[i]}${shared ? " (shared)" : ""}`,
        }, h("sub", {}, i), b);
      });
      if (r.blocks.length > MAX_CHIPS) chips.push(h("span", { class: "kvs-dim" }, ` +${r.blocks.length - MAX_CHIPS} more`));
      return h("tr", { class: r.id === selected ? "kvs-selected" : "", onclick: () => kvsSelect(model, r.id) },
        h("td", { class: "kvs-rid" }, r.id),
        h("td", { class: "kvs-num" }, `${r.num_tokens} tok / ${r.blocks.length} blk`),
        h("td", {}, chips));
    });
    el.replaceChildren(
      h("div", { class: "kvs-title" }, `Block tables \u00b7 step ${model.get("step")}`,
        h("span", { class: "kvs-dim" }, " \u00b7 logical\u2192physical; ",
          h("span", { class: "kvs-chip kvs-shared" }, "shared"), " = ref > 1")),
      rows.length
        ? h("div", { class: "kvs-scroll" }, h("table", { class: "kvs-table" }, body))
        : h("div", { class: "kvs-dim" }, "no request holds blocks at this step"),
    );
    Object.assign(el.dataset, { step: model.get("step"), numRequests: rows.length });
  }
  return kvsWatch(model, ["rows", "selected_request", "step"], draw);
}

export default { render };
