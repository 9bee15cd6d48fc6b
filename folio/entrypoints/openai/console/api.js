// Talking to the server: JSON requests and a Server-Sent Events reader for streamed answers.
// The browser adds the Basic credentials it logged in with to these same-origin requests.

// The message of an error response (OpenAI's {"error": {"message"}} body, or the status).
export async function errorMessage(response) {
  let text = "";
  try {
    text = await response.text();
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) text = body.error.message;
  } catch (_) { /* not JSON: keep the text */ }
  if (response.status === 401) {
    return "the API key was refused (401): reload the page to log in again";
  }
  return `${response.status} ${response.statusText}${text ? ": " + text : ""}`;
}

export async function fetchJSON(path, options = {}) {
  const response = await fetch(path, { cache: "no-store", ...options });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

// Yields the data of each event of an SSE body as it arrives. Events end with a blank line;
// a chunk of the stream may hold part of an event or several, so text is buffered until one
// is complete. Multi-line data fields are joined with "\n", as the SSE format says.
export async function* readSSE(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let heldCR = "";  // a "\r" ending a chunk may be the first half of "\r\n"
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      let text = heldCR + decoder.decode(value, { stream: true });
      heldCR = text.endsWith("\r") ? "\r" : "";
      if (heldCR) text = text.slice(0, -1);
      buffer += text.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = dataOf(event);
        if (data !== null) yield data;
      }
    }
    const rest = dataOf(buffer + (heldCR + decoder.decode()).replace(/\r\n?/g, "\n"));
    if (rest !== null) yield rest;
  } finally {
    // the consumer may stop early ([DONE], an error): close the connection either way
    reader.cancel().catch(() => {});
  }
}

function dataOf(event) {
  const lines = [];
  for (const line of event.split("\n")) {
    if (line.startsWith("data:")) lines.push(line.slice(line.startsWith("data: ") ? 6 : 5));
  }
  return lines.length ? lines.join("\n") : null;
}
