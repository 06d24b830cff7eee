// Light progressive enhancement: confirmations, live counts, a small live chart.
document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.dataset ? form.dataset.confirm : null;
  if (question && !window.confirm(question)) event.preventDefault();
});

async function refreshCounts() {
  try {
    const counts = await (await fetch("/api/counts")).json();
    for (const el of document.querySelectorAll("[data-count]")) {
      el.textContent = String(counts[el.dataset.count] || 0);
    }
  } catch (e) { /* the next tick retries */ }
}
setInterval(refreshCounts, 2000);

const points = [];
async function refreshChart() {
  const chart = document.getElementById("chart");
  if (!chart) return;
  try {
    const stats = await (await fetch("/api/stats")).json();
    points.push(stats.queues.reduce((sum, q) => sum + q.available, 0));
    if (points.length > 60) points.shift();
    const max = Math.max(1, ...points);
    const path = points.map((v, i) => `${i === 0 ? "M" : "L"}${i * 10},${78 - (v / max) * 70}`).join(" ");
    chart.innerHTML = "";
    const line = document.createElementNS("http://www.w3.org/2000/svg", "path");
    line.setAttribute("d", path); line.setAttribute("fill", "none"); line.setAttribute("stroke", "#1565c0");
    chart.appendChild(line);
  } catch (e) { /* the next tick retries */ }
}
setInterval(refreshChart, 2000);
refreshChart();
