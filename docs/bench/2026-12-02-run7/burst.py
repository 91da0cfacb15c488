"""Memory per stream before and after a burst that the clients read: N readers, then BURST
broadcast events of SIZE bytes in one batch, then idle. Prints PSS per connection at each step."""
import asyncio, json, os, sys, time, urllib.request

PORT, PID, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
BURST, SIZE = int(sys.argv[4]), int(sys.argv[5])

def pss():
    for line in open(f"/proc/{PID}/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024

received = 0

async def reader(i):
    global received
    r, w = await asyncio.open_connection("127.0.0.1", PORT)
    w.write(f"GET /v1/devices/burst-{i}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await w.drain()
    while True:
        data = await r.read(65536)
        if not data:
            return
        received += data.count(b"\ndata: ")
    
def publish(events):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/events", data=json.dumps(events).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req).status

async def main():
    prev = 5
    base = pss()
    tasks = [asyncio.create_task(reader(i)) for i in range(N)]
    await asyncio.sleep(3)
    opened = pss()
    print(f"open: {(opened - base) / N:.0f} B per connection")
    body = [{"broadcast": True, "data": "x" * SIZE} for _ in range(BURST)]
    status = await asyncio.get_running_loop().run_in_executor(None, publish, body)
    deadline = time.time() + 60
    while received < N * BURST and time.time() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(2)
    after = pss()
    print(f"burst: {status}, {received}/{N * BURST} events read; after it: {(after - base) / N:.0f} B per connection (+{(after - opened) / N:.0f})")
    for later in (5, 15, 30):
        await asyncio.sleep(later - (0 if later == 5 else prev))
        prev = later
        print(f"{later} s later: {(pss() - base) / N:.0f} B per connection")
    os._exit(0)

asyncio.run(main())
