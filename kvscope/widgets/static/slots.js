// Slot mapping of one step: every token computed in the step, the slot its K/V is written to,
// and that slot as (block, offset). Prefill chunks and decode rows are shown alike.
// Synced state: `groups` ([{id, kind, num_tokens, tokens: [[position, token_id, text, slot, block,
// offset]]}], `tokens` being the first ones only for long prefill chunks), `block_size`,
// `selected_request`, `step`.

function render({ model, el }) {
  el.classList.add("kvs-view", "kvs-slots");
  el.dataset.kvscopeView = "slots";

  function draw() {
    const t0 = performance.now();
    const groups = model.get("groups") || [];
    const selected = model.get("selected_request");
    let total = 0;
    const parts = groups.map((g) => {
      total += g.num_tokens;
      const first = g.tokens[0][0], last = first + g.num_tokens - 1; // a chunk's positions are contiguous
      const cells = g.tokens.map(([pos, tok, text, slot, block, off]) =>
        h("div", { class: "kvs-slot", title: `position ${pos} \u00b7 token ${tok} \u2192 slot ${slot} = block ${block} \u00d7 ${model.get("block_size")} + ${off}` },
          h("code", {}, kvsShowText(text) || "\u2205"), h("small", {}, `${slot} = ${block}\u00b7${off}`)));
      if (g.num_tokens > g.tokens.length) cells.push(h("span", { class: "kvs-dim" }, `+${g.num_tokens - g.tokens.length} more`));
      return h("div", { class: `kvs-slot-group ${g.id === selected ? "kvs-selected" : ""}`, "data-rid": g.id },
        h("div", { class: "kvs-slot-head", onclick: () => kvsSelect(model, g.id) },
          h("span", { class: `kvs-badge kvs-${g.kind}` }, g.kind), ` request ${g.id} \u00b7 `,
          first === last ? `position ${first}` : `positions ${first}\u2013${last} (${g.num_tokens} tokens)`),
        h("div", { class: "kvs-slot-row" }, cells));
    });
    el.replaceChildren(
      h("div", { class: "kvs-title" }, `Slot mapping \u00b7 step ${model.get("step")} \u00b7 ${total} tokens`,
        h("span", { class: "kvs-dim" }, " \u00b7 slot = block \u00d7 block_size + offset")),
      groups.length ? h("div", { class: "kvs-scroll" }, parts) : h("div", { class: "kvs-dim" }, "nothing computed at this step"),
    );
    Object.assign(el.dataset, { step: model.get("step"), numTokens: total, drawMs: (performance.now() - t0).toFixed(1) });
  }
  return kvsWatchView(model, el, ["groups", "step", "block_size"], draw);
}

export default { render };
