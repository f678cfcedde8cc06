/* The book's small page helpers (added to every page by _ext/book_pages.py). */
(function () {
  "use strict";
  // The .ipynb download button saves the notebook instead of showing its JSON in a tab.
  function downloads() {
    document.querySelectorAll("a[href*='_sources/'][href$='.ipynb']").forEach(function (a) {
      a.setAttribute("download", a.pathname.split("/").pop());
      a.removeAttribute("target");
    });
  }
  // Numbers stay on one line ("8.5e-08", not "8.5e-/08").
  var NUMBER = /^[\s(]*[-+−]?(\d[\d,_]*\.?\d*|\.\d+)([eE][-+−]?\d+)?\s*(%|×|x|ms|GB\/s|s)?[)\s]*$/;
  function numbers() {
    document.querySelectorAll("main td, main th").forEach(function (c) {
      if (NUMBER.test(c.textContent)) c.classList.add("num");
    });
  }
  // A wide table says that it scrolls (on a phone the scrollbar is hidden until touched).
  function scrollCues() {
    document.querySelectorAll("main table").forEach(function (t) {
      var box = t.parentElement;
      while (box && box !== document.body && getComputedStyle(box).overflowX === "visible") {
        box = box.parentElement;
      }
      if (!box || box === document.body) {
        // A table in prose has no scrolling box of its own: give it one.
        box = document.createElement("div");
        box.className = "table-scroll";
        t.parentNode.insertBefore(box, t);
        box.appendChild(t);
      }
      var wide = box.scrollWidth > box.clientWidth + 2;
      var cue = box.previousElementSibling;
      var has = cue && cue.classList.contains("scroll-cue");
      if (wide && !has) {
        cue = document.createElement("div");
        cue.className = "scroll-cue";
        cue.textContent = "wide table: scroll sideways →";
        box.parentNode.insertBefore(cue, box);
      } else if (!wide && has) {
        cue.remove();
      }
      box.classList.toggle("scrolls-x", wide);
    });
  }
  function all() { downloads(); numbers(); scrollCues(); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
  window.addEventListener("resize", scrollCues);
  // Math typeset after load can widen a table: look again once the page and MathJax are done.
  window.addEventListener("load", function () {
    scrollCues();
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise.then(scrollCues);
    }
    setTimeout(scrollCues, 100);
  });
})();
