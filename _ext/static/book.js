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
  // A wide table or equation says that it scrolls (on a phone the scrollbar is hidden until
  // touched): a cue above its scrolling box.
  function cue(box, before, wide, what) {
    var el = before.previousElementSibling;
    var has = el && el.classList.contains("scroll-cue");
    if (wide && !has) {
      el = document.createElement("div");
      el.className = "scroll-cue";
      el.textContent = "wide " + what + ": scroll sideways →";
      before.parentNode.insertBefore(el, before);
    } else if (!wide && has) {
      el.remove();
    }
    box.classList.toggle("scrolls-x", wide);
  }
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
      cue(box, box, box.scrollWidth > box.clientWidth + 2, "table");
    });
    // Inline math wider than its line cannot wrap (MathJax sets a formula in one box): it is
    // set on a line of its own that scrolls (book.css), with the cue above it.
    document.querySelectorAll("main article mjx-container:not([display='true'])").forEach(
      function (m) {
        var block = m.parentElement;
        while (block && getComputedStyle(block).display.indexOf("inline") === 0) {
          block = block.parentElement;
        }
        if (!block) return;
        var cs = getComputedStyle(block);
        var room = block.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
        var own = m.classList.contains("math-wide");
        var width = own ? m.scrollWidth : m.getBoundingClientRect().width;
        var wideNow = width > room + 1;
        if (wideNow !== own) m.classList.toggle("math-wide", wideNow);
        if (wideNow || own) cue(m, m, wideNow && m.scrollWidth > m.clientWidth + 2, "formula");
      }
    );
    // A display equation scrolls in its MathJax container (book.css); the cue goes above the
    // equation's block.
    document.querySelectorAll("main div.math").forEach(function (m) {
      var box = m.querySelector("mjx-container");
      if (box) cue(box, m, box.scrollWidth > box.clientWidth + 2, "equation");
    });
  }
  // The table of contents on a phone. pydata-sphinx-theme 0.17 binds its sidebar dialogs to
  // the first .primary-toggle / .secondary-toggle in the page, a button in its own header that
  // sphinx-book-theme hides; the toggles a reader sees (the article header's) get no listener
  // and a tap does nothing (pydata/pydata-sphinx-theme#2451). A tap on a visible toggle is
  // passed to the bound one, which opens the dialog. At laptop width the primary toggle hides
  // and shows the sidebar (the theme's own button there opens it as a dialog).
  function wide() {
    return window.matchMedia("(min-width: 992px)").matches;
  }
  function navigation() {
    ["primary", "secondary"].forEach(function (side) {
      var all = document.querySelectorAll("." + side + "-toggle");
      var bound = all[0];
      for (var i = 1; i < all.length; i++) {
        all[i].addEventListener("click", function (e) {
          e.preventDefault();
          e.stopImmediatePropagation();
          if (side === "primary" && wide()) {
            var hidden = document.documentElement.classList.toggle("book-nav-hidden");
            e.currentTarget.setAttribute("aria-expanded", hidden ? "false" : "true");
          } else {
            bound.click();
          }
        }, true);
      }
    });
  }
  // Search results quote the page's text; its math is LaTeX until MathJax runs, so the
  // snippet would read "\\frac{x_i}{r}". Sphinx's search reads each page through
  // Search.htmlToText: give it the math as plain text (Greek letters as symbols, commands
  // and braces dropped) before it takes the words around the match.
  var GREEK = {alpha: "α", beta: "β", gamma: "γ", delta: "δ", epsilon: "ε", eta: "η",
    theta: "θ", lambda: "λ", mu: "μ", pi: "π", rho: "ρ", sigma: "σ", tau: "τ", phi: "φ",
    psi: "ψ", omega: "ω", Sigma: "Σ", Delta: "Δ", cdot: "·", times: "×", le: "≤", ge: "≥",
    leq: "≤", geq: "≥", approx: "≈", ne: "≠", neq: "≠", infty: "∞", sum: "Σ", sqrt: "√",
    partial: "∂", to: "→", in: "∈", ell: "ℓ", prime: "′", ldots: "…", dots: "…"};
  function plainMath(tex) {
    return tex
      .replace(/^\\[(\[]|\\[)\]]$/g, "")
      .replace(/\\(?:t?frac|dfrac)\{([^{}]*)\}\{([^{}]*)\}/g, "($1)/($2)")
      .replace(/\\([A-Za-z]+)/g, function (m, name) {
        return GREEK.hasOwnProperty(name) ? GREEK[name] : " ";
      })
      .replace(/\\[,;:!| ]/g, " ")
      .replace(/[{}&]/g, "")
      .replace(/\s+/g, " ")
      .trim();
  }
  function plainSearchSnippets() {
    if (typeof Search === "undefined" || !Search.htmlToText || Search.bookPlain) return;
    var toText = Search.htmlToText;
    Search.htmlToText = function (html, anchor) {
      var doc = new DOMParser().parseFromString(html, "text/html");
      doc.querySelectorAll(".math, mjx-container").forEach(function (el) {
        el.replaceWith(doc.createTextNode(" " + plainMath(el.textContent) + " "));
      });
      return toText(doc.documentElement.outerHTML, anchor);
    };
    Search.bookPlain = true;
  }
  plainSearchSnippets();
  function all() { downloads(); numbers(); scrollCues(); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", navigation);
  } else navigation();
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
