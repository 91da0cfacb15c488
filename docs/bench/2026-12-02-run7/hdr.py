"""PSS per idle stream whose request carries a header of PAD bytes (e.g. a JWT)."""
import asyncio, sys
PORT, PID, N, PAD = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def pss():
    for line in open(f"/proc/{PID}/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
async def reader(i):
    r, w = await asyncio.open_connection("127.0.0.1", PORT)
    w.write(f"GET /v1/devices/hdr-{i}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {'t' * PAD}\r\n\r\n".encode())
    await w.drain()
    while await r.read(65536):
        pass
async def main():
    base = pss()
    tasks = [asyncio.create_task(reader(i)) for i in range(N)]
    await asyncio.sleep(4)
    print(f"header {PAD} B: {(pss() - base) / N:.0f} B per connection")
asyncio.run(main())
