"""``/docs``: the HTTP API as one plain HTML page made from the app's OpenAPI schema. FastAPI's
own page loads Swagger UI from a CDN, which a machine without internet access shows blank."""
from __future__ import annotations

from html import escape

_STYLE = ("body{font:14px system-ui,sans-serif;margin:2em;max-width:70em}"
          "table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;"
          "padding:.35em .5em;text-align:left;vertical-align:top}code{font-size:13px}"
          ".m{font-weight:600}")


def api_page(schema: dict) -> str:
    """Every operation: method, path, summary and description, parameters, body, responses."""
    rows = []
    for path, ops in sorted(schema.get("paths", {}).items()):
        for method, op in ops.items():
            params = ", ".join(
                f"{p['name']} ({p.get('in', '')}{', required' if p.get('required') else ''})"
                for p in op.get("parameters", []))
            body = "JSON body" if "requestBody" in op else ""
            responses = ", ".join(sorted(op.get("responses", {})))
            text = op.get("description") or op.get("summary") or ""
            rows.append(
                f"<tr><td class=m>{escape(method.upper())}</td><td><code>{escape(path)}</code></td>"
                f"<td>{escape(text)}</td><td>{escape(', '.join(x for x in (params, body) if x))}</td>"
                f"<td>{escape(responses)}</td></tr>")
    if "/v1/traces" not in schema.get("paths", {}):  # the receiver keeps out of the schema
        rows.insert(0, "<tr><td class=m>POST</td><td><code>/v1/traces</code></td><td>OTLP/HTTP "
                       "trace export (application/x-protobuf or application/json, gzip allowed) "
                       "from rtxops jobs or any OpenTelemetry SDK</td><td>the token</td>"
                       "<td>200, 400, 401, 408, 413, 415, 429, 503</td></tr>")
    info = schema.get("info", {})
    return ("<!doctype html><meta charset=utf-8><title>rtxops API</title>"
            f"<style>{_STYLE}</style><h1>{escape(info.get('title', 'API'))} "
            f"{escape(str(info.get('version', '')))}</h1>"
            "<p>The machine-readable schema: <a href=/openapi.json>/openapi.json</a>. Writes need "
            "<code>Authorization: Bearer &lt;token&gt;</code> (the token is in the home's "
            "<code>token</code> file).</p><table><tr><th>method</th><th>path</th><th>what</th>"
            "<th>parameters</th><th>responses</th></tr>" + "".join(rows) + "</table>")
