// The console's entry point: two views (chat, dashboard) switched by the URL's hash, so each
// has its own address (/#chat, /#dashboard) and the back button works.
import { initChat } from "./chat.js";
import { showDashboard } from "./dashboard.js";

const VIEWS = ["chat", "dashboard"];

function route() {
  const wanted = location.hash.replace(/^#/, "");
  const current = VIEWS.includes(wanted) ? wanted : "chat";
  for (const view of VIEWS) {
    document.getElementById(`${view}-view`).hidden = view !== current;
    document.getElementById(`tab-${view}`).classList.toggle("active", view === current);
  }
  document.body.dataset.view = current;
  showDashboard(current === "dashboard");
}

window.addEventListener("hashchange", route);
route();
initChat().finally(() => { document.body.dataset.ready = "true"; });
