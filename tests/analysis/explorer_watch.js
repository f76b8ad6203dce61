// Added first to a copy of the page: records script errors, console errors and warnings, blocked requests.
window.__problems = [];
window.addEventListener("error", e => __problems.push("script error: " + e.message));
window.addEventListener("securitypolicyviolation", e => __problems.push("request blocked: " + e.blockedURI));
for (const level of ["error", "warn"]) {
  const original = console[level];
  console[level] = (...args) => { __problems.push("console." + level + ": " + args.join(" ")); original.apply(console, args); };
}
