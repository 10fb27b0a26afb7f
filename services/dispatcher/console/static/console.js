// Temper console: refresh the job page's live section while the job runs.
(function () {
  "use strict";
  function schedule(section) {
    var seconds = parseFloat(section.getAttribute("data-refresh"));
    var src = section.getAttribute("data-src");
    if (!seconds || !src) return;
    setTimeout(function () {
      fetch(src, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
        .then(function (html) {
          var box = document.createElement("div");
          box.innerHTML = html;
          var fresh = box.querySelector("#live");
          if (fresh) { section.replaceWith(fresh); schedule(fresh); }
        })
        .catch(function () { schedule(section); });
    }, seconds * 1000);
  }
  document.addEventListener("DOMContentLoaded", function () {
    var live = document.getElementById("live");
    if (live) schedule(live);
  });
})();
