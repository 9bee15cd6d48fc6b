// A small line chart on a <canvas>: time on x (the last `spanSeconds` up to `now`), one or
// more series on y from 0 to a rounded maximum. Missing values (null) break a line.

// 1, 2 or 5 times a power of ten, at least `value`: y-axis steps that read well.
function niceCeiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) {
    if (step * power >= value) return step * power;
  }
  return 10 * power;
}

function formatTick(value) {
  if (value >= 1000) return `${(value / 1000).toFixed(value >= 10000 ? 0 : 1)}k`;
  return Number.isInteger(value) ? String(value) : String(Number(value.toPrecision(3)));
}

function cssColor(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

// series: [{ values: number|null per time, color: CSS color }]; integer: counts (whole steps)
export function drawLineChart(canvas, { times, series, now, spanSeconds, integer = false }) {
  // Draw at the device's pixel density so lines stay sharp.
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);

  const pad = { left: 44, right: 10, top: 10, bottom: 22 };
  const plotW = Math.max(1, width - pad.left - pad.right);
  const plotH = Math.max(1, height - pad.top - pad.bottom);
  const start = now - spanSeconds;
  const x = (t) => pad.left + ((t - start) / spanSeconds) * plotW;
  let highest = 0;
  for (const { values } of series) {
    values.forEach((v, i) => { if (v !== null && times[i] >= start) highest = Math.max(highest, v); });
  }
  // four grid steps of a round size
  let gridStep = niceCeiling(highest / 4);
  if (integer) gridStep = Math.max(1, Math.ceil(gridStep));
  const top = gridStep * 4;
  const y = (v) => pad.top + plotH - (v / top) * plotH;

  const muted = cssColor("--muted", "#888");
  const line = cssColor("--line", "#ddd");
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;

  // horizontal grid and y labels
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const value = (top * i) / 4;
    const py = Math.round(y(value)) + 0.5;
    ctx.strokeStyle = line;
    ctx.beginPath(); ctx.moveTo(pad.left, py); ctx.lineTo(pad.left + plotW, py); ctx.stroke();
    ctx.fillStyle = muted;
    ctx.fillText(formatTick(value), pad.left - 6, py);
  }
  // x labels: one per minute back from now (or every 10 s on a short span)
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const step = spanSeconds > 120 ? 60 : 10;
  for (let back = 0; back <= spanSeconds; back += step) {
    const px = x(now - back);
    const label = back === 0 ? "now" : step === 60 ? `-${back / 60}m` : `-${back}s`;
    ctx.fillStyle = muted;
    ctx.fillText(label, Math.min(Math.max(px, pad.left + 12), pad.left + plotW - 12),
                 pad.top + plotH + 5);
  }

  // the series
  ctx.save();
  ctx.beginPath();
  ctx.rect(pad.left, pad.top - 1, plotW, plotH + 2);
  ctx.clip();
  ctx.lineWidth = 1.75;
  ctx.lineJoin = "round";
  for (const { values, color } of series) {
    ctx.strokeStyle = color;
    ctx.beginPath();
    let drawing = false;
    values.forEach((v, i) => {
      if (v === null || v === undefined) { drawing = false; return; }
      const px = x(times[i]);
      const py = y(v);
      if (drawing) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      drawing = true;
    });
    ctx.stroke();
  }
  ctx.restore();
}

export { cssColor };
