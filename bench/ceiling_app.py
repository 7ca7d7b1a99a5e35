"""The framework ceiling: the smallest bottle app on waitress that answers like the service
(a JSON GET, and a POST that parses a JSON body), with the same thread count.

waitress logs a warning for every request that waits for a free thread; under the bench's
load that is most requests. The ceiling must be the least the stack can do, so that logger is
off here (the service counts those requests instead, see OverloadLog in ordering.py)."""

import json
import logging
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
    logging.getLogger("waitress.queue").disabled = True
    waitress.serve(app, host="127.0.0.1", port=int(sys.argv[1]), threads=int(sys.argv[2]),
                   _quiet=True)
