// Added last to a copy of the page: measures the rendered boxes and writes every problem into the probe element.
(function () {
  const problems = window.__problems;
  const width = document.documentElement.clientWidth;
  const name = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className && typeof el.className === "string" ? "." + el.className.trim().split(/\s+/).join(".") : "") + " '" + (el.textContent || "").trim().slice(0, 40) + "'";
  const laidOut = el => {
    const style = getComputedStyle(el);
    if (style.display === "none" || style.visibility === "hidden") return false;
    const box = el.getBoundingClientRect();
    return box.width > 0 && box.height > 0;
  };
  if (document.documentElement.scrollWidth > width + 1) problems.push("the page scrolls sideways: " + document.documentElement.scrollWidth + " > " + width);
  const elements = [...document.body.querySelectorAll("*")].filter(el => !(el instanceof SVGElement) || el.tagName === "svg");
  for (const el of elements) {
    if (!laidOut(el) || el.closest("select")) continue;
    const box = el.getBoundingClientRect();
    if (box.left < -1 || box.right > width + 1) problems.push("outside the page: " + name(el));
    const style = getComputedStyle(el);
    if (style.overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1) problems.push("cut off: " + name(el));
  }
  const ruler = document.createElement("canvas").getContext("2d");
  for (const input of document.querySelectorAll("input[placeholder]")) {  // a placeholder must show whole
    if (!laidOut(input)) continue;
    const style = getComputedStyle(input);
    ruler.font = style.font;
    const room = input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    if (ruler.measureText(input.placeholder).width > room + 1) problems.push("placeholder cut off: " + name(input) + " '" + input.placeholder + "'");
  }
  for (const parent of [document.body, ...elements]) {
    const boxes = [...parent.children].filter(el => {
      if (!laidOut(el) || el.closest("select") || (el instanceof SVGElement && el.tagName !== "svg")) return false;
      const style = getComputedStyle(el);
      return style.display !== "inline" && style.position !== "absolute" && style.position !== "fixed";
    }).map(el => [el, el.getBoundingClientRect()]);
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
      const [a, p] = boxes[i], [b, q] = boxes[j];
      const x = Math.min(p.right, q.right) - Math.max(p.left, q.left), y = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
      if (x > 1 && y > 1) problems.push("overlap: " + name(a) + " and " + name(b));
    }
  }
  const out = document.createElement("pre");
  out.id = "probe";
  out.style.display = "none";
  const button = document.querySelector("nav.layers button:last-child");  // where a click on a layer leads
  let clicked = null;
  if (button) {
    const before = location.href;
    button.click();
    clicked = location.hash;
    history.replaceState(null, "", before);  // the page shows the view it was opened at again
  }
  out.textContent = JSON.stringify({problems: problems, title: document.title, ready: document.body.dataset.ready === "true",
    clicked: clicked});
  document.body.appendChild(out);
})();
