// The run page: timeline details and fan-out rows, relative times that age, and the live
// update (the page fetches its changing part, /runs/<id>/live, until the run ends).
(() => {
  const POLL_MS = 1500;
  const expanded = new Set();  // fan-out rows the viewer opened
  let selected = null;         // [node, bar index] whose details are shown

  // The same rules as cyclone_dsl.ui.humane.ago.
  function agoText(seconds) {
    const future = seconds < 0;
    const s = Math.abs(seconds);
    if (s < 5) return "just now";
    let text;
    if (s < 60) text = `${Math.floor(s)} s`;
    else if (s < 3600) text = `${Math.floor(s / 60)} min`;
    else if (s < 48 * 3600) text = `${Math.floor(s / 3600)} h`;
    else text = `${Math.floor(s / 86400)} days`;
    return future ? `in ${text}` : `${text} ago`;
  }

  // "now" on the server's clock: its time at load, plus the time since.
  const serverNow = Date.parse(document.body.dataset.now || "") || Date.now();
  const loadedAt = Date.now();
  function refreshAgo() {
    const now = serverNow + (Date.now() - loadedAt);
    for (const el of document.querySelectorAll("time[data-ago]")) {
      el.textContent = agoText((now - Date.parse(el.getAttribute("datetime"))) / 1000);
    }
  }
  setInterval(refreshAgo, 10000);

  function itemRows(row) {
    const timeline = row.closest(".timeline");
    return [...timeline.querySelectorAll(".tl-row.item")].filter(
      (item) => item.dataset.itemOf === row.dataset.node);
  }

  function setOpen(row, open) {
    row.setAttribute("aria-expanded", open ? "true" : "false");
    const toggle = row.querySelector(".tl-toggle");
    if (toggle) toggle.textContent = open ? "▾" : "▸";
    for (const item of itemRows(row)) item.hidden = !open;
    if (open) expanded.add(row.dataset.node); else expanded.delete(row.dataset.node);
  }

  function showDetail(bar) {
    const timeline = bar.closest(".timeline");
    const panel = timeline.querySelector(".tl-detail");
    for (const old of timeline.querySelectorAll("g.bar.selected")) old.classList.remove("selected");
    bar.classList.add("selected");
    panel.textContent = bar.dataset.detail;
    panel.hidden = false;
    selected = [bar.closest(".tl-row").dataset.node, bar.dataset.index];
  }

  document.addEventListener("click", (event) => {
    const bar = event.target.closest(".timeline g.bar");
    if (bar) { showDetail(bar); return; }
    const row = event.target.closest(".tl-row.fanout");
    if (row && !event.target.closest("a")) {
      setOpen(row, row.getAttribute("aria-expanded") !== "true");
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" && event.key !== " ") return;
    const bar = event.target.closest && event.target.closest(".timeline g.bar");
    if (bar) { event.preventDefault(); showDetail(bar); }
  });

  function restore(live, openDetails) {
    for (const row of live.querySelectorAll(".tl-row.fanout")) {
      if (expanded.has(row.dataset.node)) setOpen(row, true);
    }
    if (selected) {
      const [node, index] = selected;
      const row = [...live.querySelectorAll(".tl-row")].find((r) => r.dataset.node === node);
      const bar = row && row.querySelector(`g.bar[data-index="${index}"]`);
      if (bar) showDetail(bar);
    }
    live.querySelectorAll("details").forEach((d, i) => { if (openDetails.has(i)) d.open = true; });
  }

  async function poll() {
    const live = document.getElementById("live");
    if (!live) return;
    const state = live.querySelector("#live-state");
    if (state && state.dataset.terminal === "true") return;  // the run ended: nothing moves
    const active = document.activeElement;
    const typing = active && live.contains(active) && ["INPUT", "TEXTAREA", "SELECT"].includes(active.tagName);
    // A form the viewer has filled in stays as it is until it is sent.
    const edited = [...live.querySelectorAll("input, textarea")].some(
      (field) => field.type !== "hidden" && field.value !== field.defaultValue);
    if (!document.hidden && !typing && !edited) {
      try {
        const response = await fetch(live.dataset.live, { cache: "no-store" });
        if (response.ok) {
          const html = await response.text();
          const openDetails = new Set();
          live.querySelectorAll("details").forEach((d, i) => { if (d.open) openDetails.add(i); });
          live.innerHTML = html;
          restore(live, openDetails);
          live.dataset.updates = String(Number(live.dataset.updates || 0) + 1);
        }
      } catch (e) { /* the next tick retries */ }
    }
    setTimeout(poll, POLL_MS);
  }
  if (document.getElementById("live")) setTimeout(poll, POLL_MS);
})();
