() => {
  // gr.Plot has no click event (Gradio 6: only `change`), so a click on a tree node is caught in the page: Plotly's
  // plotly_click on the tree's plot div (Gradio re-draws it with Plotly.react, which keeps listeners) writes the
  // node's id (customdata[0], set by tree_figure.tree_traces) into the node picker and fires its input event, the
  // same event typing an id fires.
  const hook = (plot) => {
    if (plot.__treevizClick || typeof plot.on !== "function") return;
    plot.__treevizClick = true;
    plot.on("plotly_click", (event) => {
      const point = event && event.points && event.points[0];
      const id = point && point.customdata ? point.customdata[0] : null;
      const box = document.querySelector("#tv-node input");
      if (id === null || id === undefined || !box) return;
      box.value = String(id);
      box.dispatchEvent(new Event("input", {bubbles: true}));
    });
  };
  const scan = () => document.querySelectorAll("#tv-tree .js-plotly-plot").forEach(hook);
  new MutationObserver(scan).observe(document.body, {childList: true, subtree: true});
  scan();
}
