"""The framework ceiling: the smallest bottle app on waitress that answers like the service
(a JSON GET, and a POST that parses a JSON body), with the same thread count."""

import json
import sys

import bottle
import waitress

app = bottle.Bottle()
ORDER = {"id": "ord_0", "status": "SUBMITTED", "total": 12.5, "items": []}


@app.get("/get")
def get():
    bottle.response.content_type = "application/json"
    return json.dumps({"data": ORDER})


@app.post("/post")
def post():
    body = json.loads(bottle.request.body.read())
    bottle.response.content_type = "application/json"
    bottle.response.status = 201
    return json.dumps({"data": dict(ORDER, customerId=body.get("customerId"))})


if __name__ == "__main__":
    waitress.serve(app, host="127.0.0.1", port=int(sys.argv[1]), threads=int(sys.argv[2]),
                   _quiet=True)
