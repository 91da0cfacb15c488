//! The floor of a broadcast on this machine: the least work any SSE server can do per delivery.
//!
//! Not posthorn. A deliberately bare event server that speaks the part of nchan's protocol the
//! load tool uses (`GET /sub/{device}` opens an event stream, `POST /pub/broadcast` publishes the
//! body as one `data:` event to all; `POST /pub/{device}` to that device only, but by walking
//! every subscriber: this is a broadcast floor, not a unicast one), so that
//! `posthorn loadtest fanout --peer nchan` can measure it exactly like nchan and posthorn. Each
//! of its threads owns an epoll instance and a `SO_REUSEPORT` listener, accepts and answers on
//! that thread, and delivers an event with one `send` per subscriber in a tight loop: no tasks,
//! no wake-ups, no per-connection queue, no heartbeats, no resume, no eviction. What it costs per
//! delivery is what the kernel costs (the `send`, and on loopback the receiving socket's TCP
//! input, run by the sender), so its latency is a lower bound for any real server measured the
//! same way on the same cores. docs/BENCHMARKS.md uses it to tell the floor of the machine from
//! the cost of the hub.
//!
//! ```text
//! cargo bench --bench sse_floor -- --listen 127.0.0.1:18080 --threads 2
//! ```
//!
//! A subscriber that cannot take a whole event keeps the rest in a buffer written when its
//! socket drains; one that falls a megabyte behind is closed. Loopback only: it refuses any other
//! listening address.

use std::{
    collections::HashMap,
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    sync::{mpsc, Arc},
    thread,
};

use posthorn::http::server::is_resource_shortage;

/// Largest request (head and body) accepted.
const MAX_REQUEST: usize = 64 * 1024;
/// A subscriber this far behind is closed.
const MAX_BEHIND: usize = 1024 * 1024;
const LISTENER: u64 = u64::MAX;
const WAKER: u64 = u64::MAX - 1;
const STREAM_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
Cache-Control: no-cache\r\nConnection: close\r\n\r\n";
const CREATED: &[u8] = b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n";

fn main() {
    // `cargo test --all-targets` runs every bench target once, without arguments, where `cargo
    // bench` passes `--bench`: a server that never ends must not hold up the test suite.
    if std::env::args().len() == 1 {
        eprintln!(
            "sse_floor: a benchmark server; run `cargo bench --bench sse_floor` (see its doc)"
        );
        return;
    }
    let (listen, threads) = match parse_args(std::env::args().skip(1)) {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("sse_floor: {message}");
            eprintln!("usage: sse_floor [--listen 127.0.0.1:18080] [--threads 2]");
            std::process::exit(2);
        }
    };
    if let Err(error) = run(listen, threads) {
        eprintln!("sse_floor: {error}");
        std::process::exit(1);
    }
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<(SocketAddr, usize), String> {
    let mut listen: SocketAddr = "127.0.0.1:18080".parse().expect("static address");
    let mut threads = 2;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => {
                let value = args.next().ok_or("--listen needs an address")?;
                listen = value
                    .parse()
                    .map_err(|_| format!("--listen {value:?} is not ip:port"))?;
            }
            "--threads" => {
                let value = args.next().ok_or("--threads needs a number")?;
                threads = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(|| format!("--threads {value:?} is not 1..=64"))?;
            }
            // `cargo bench` passes this to every bench binary.
            "--bench" => {}
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !listen.ip().is_loopback() {
        return Err(format!("{listen} is not a loopback address"));
    }
    Ok((listen, threads))
}

fn run(listen: SocketAddr, threads: usize) -> io::Result<()> {
    let mut inboxes = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..threads {
        let (sender, receiver) = mpsc::channel::<Published>();
        inboxes.push(receiver);
        peers.push((sender, event_fd()?));
    }
    let peers: Peers = Arc::new(peers);
    let mut workers = Vec::new();
    for (index, inbox) in inboxes.into_iter().enumerate() {
        let listener = reuse_port_listener(listen)?;
        let peers = peers.clone();
        workers.push(thread::spawn(move || {
            if let Err(error) = Worker::new(index, listener, inbox, peers).and_then(Worker::run) {
                // A thread that died would leave its share of the clients silently unserved.
                eprintln!("sse_floor: thread {index}: {error}");
                std::process::exit(1);
            }
        }));
    }
    eprintln!("sse_floor: listening on {listen} with {threads} threads");
    for worker in workers {
        worker.join().expect("a worker panicked");
    }
    Ok(())
}

/// An event handed to another thread: the channel (`None` for broadcast) and its frame.
type Published = (Option<String>, Arc<[u8]>);

/// Every thread's inbox and the eventfd that wakes it, by thread index.
type Peers = Arc<Vec<(mpsc::Sender<Published>, OwnedFd)>>;

struct Connection {
    stream: TcpStream,
    input: Vec<u8>,
    /// Bytes of a subscriber's stream the socket did not take yet.
    behind: Vec<u8>,
    subscription: Option<Subscription>,
}

struct Subscription {
    channel: String,
    /// Where the connection is in `Worker::subscribers`.
    slot: usize,
}

struct Worker {
    index: usize,
    epoll: OwnedFd,
    listener: TcpListener,
    /// False while accepting is paused for want of descriptors or memory.
    accepting: bool,
    inbox: mpsc::Receiver<Published>,
    peers: Peers,
    connections: HashMap<u64, Connection>,
    /// Subscribers in a dense list, so a broadcast walks an array.
    subscribers: Vec<u64>,
    next_id: u64,
}

impl Worker {
    fn new(
        index: usize,
        listener: TcpListener,
        inbox: mpsc::Receiver<Published>,
        peers: Peers,
    ) -> io::Result<Self> {
        // SAFETY: plain syscall; the result is checked.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        listener.set_nonblocking(true)?;
        let worker = Self {
            index,
            epoll,
            listener,
            accepting: true,
            inbox,
            peers,
            connections: HashMap::new(),
            subscribers: Vec::new(),
            next_id: 0,
        };
        worker.watch(worker.listener.as_raw_fd(), LISTENER, libc::EPOLLIN)?;
        worker.watch(worker.peers[index].1.as_raw_fd(), WAKER, libc::EPOLLIN)?;
        Ok(worker)
    }

    fn watch(&self, fd: RawFd, token: u64, events: i32) -> io::Result<()> {
        self.control(libc::EPOLL_CTL_ADD, fd, token, events)
    }

    fn control(&self, op: i32, fd: RawFd, token: u64, events: i32) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: events as u32,
            u64: token,
        };
        // SAFETY: `event` lives across the call; the kernel copies it.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut event) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn run(mut self) -> io::Result<()> {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        loop {
            // SAFETY: `events` has room for its length of entries.
            let ready = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    -1,
                )
            };
            if ready < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            for event in &events[..ready as usize] {
                let (token, flags) = (event.u64, event.events);
                match token {
                    LISTENER => self.accept(),
                    WAKER => self.take_published(),
                    id if flags & libc::EPOLLOUT as u32 != 0 => self.catch_up(id),
                    id => self.readable(id),
                }
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
                        continue;
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    if self.watch(stream.as_raw_fd(), id, libc::EPOLLIN).is_ok() {
                        self.connections.insert(
                            id,
                            Connection {
                                stream,
                                input: Vec::new(),
                                behind: Vec::new(),
                                subscription: None,
                            },
                        );
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if is_resource_shortage(&error) => {
                    // The listener is level-triggered and would wake us again at once: stop
                    // watching it until a connection closes.
                    let fd = self.listener.as_raw_fd();
                    if self.control(libc::EPOLL_CTL_DEL, fd, LISTENER, 0).is_ok() {
                        self.accepting = false;
                    }
                    return;
                }
                // Reset or aborted before we took it: the next one.
                Err(_) => {}
            }
        }
    }

    fn take_published(&mut self) {
        let mut count = [0u8; 8];
        // SAFETY: reads the 8-byte counter of our own eventfd; a spurious wake-up reads nothing.
        unsafe {
            libc::read(
                self.peers[self.index].1.as_raw_fd(),
                count.as_mut_ptr().cast(),
                8,
            )
        };
        while let Ok((channel, frame)) = self.inbox.try_recv() {
            self.deliver(channel.as_deref(), &frame);
        }
    }

    fn readable(&mut self, id: u64) {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let Some(connection) = self.connections.get_mut(&id) else {
                return;
            };
            match connection.stream.read(&mut buf) {
                Ok(0) => break,
                // A subscriber sends nothing after its request.
                Ok(_) if connection.subscription.is_some() => {}
                Ok(n) => {
                    connection.input.extend_from_slice(&buf[..n]);
                    // Served after every read, so that a pipelined batch is bounded by one
                    // request, not by the whole batch.
                    if !self.serve_requests(id) {
                        return;
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.close(id);
    }

    /// Answers every complete request buffered on `id`; false when the connection was closed.
    fn serve_requests(&mut self, id: u64) -> bool {
        while let Some(request) = self.next_request(id) {
            let answered = match request {
                Request::Subscribe(channel) => {
                    let connection = self.connections.get_mut(&id).expect("present");
                    connection.subscription = Some(Subscription {
                        channel,
                        slot: self.subscribers.len(),
                    });
                    self.subscribers.push(id);
                    self.send(id, STREAM_HEAD)
                }
                Request::Publish(channel, data) => {
                    let mut frame = Vec::with_capacity(data.len() + 8);
                    frame.extend_from_slice(b"data: ");
                    frame.extend_from_slice(&data);
                    frame.extend_from_slice(b"\n\n");
                    let frame: Arc<[u8]> = frame.into();
                    let channel = (channel != "broadcast").then_some(channel);
                    for (peer, (inbox, waker)) in self.peers.iter().enumerate() {
                        if peer != self.index
                            && inbox.send((channel.clone(), frame.clone())).is_ok()
                        {
                            wake(waker);
                        }
                    }
                    self.deliver(channel.as_deref(), &frame);
                    self.send(id, CREATED)
                }
                Request::Bad => {
                    self.send(id, b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n");
                    self.close(id);
                    return false;
                }
            };
            if !answered {
                return false;
            }
        }
        true
    }

    /// The next complete request buffered on `id`, removed from its input.
    fn next_request(&mut self, id: u64) -> Option<Request> {
        let connection = self.connections.get_mut(&id)?;
        if connection.subscription.is_some() {
            return None;
        }
        let input = &connection.input;
        let Some(end) = input.windows(4).position(|w| w == b"\r\n\r\n") else {
            return (input.len() > MAX_REQUEST).then_some(Request::Bad);
        };
        let Ok(head) = std::str::from_utf8(&input[..end]) else {
            return Some(Request::Bad);
        };
        let mut lines = head.split("\r\n");
        let mut start = lines.next().unwrap_or("").split(' ');
        let (method, path) = (start.next().unwrap_or(""), start.next().unwrap_or(""));
        let length: usize = lines
            .filter_map(|line| line.split_once(':'))
            .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, value)| value.trim().parse().ok())
            .unwrap_or(0);
        let body_start = end + 4;
        if body_start + length > MAX_REQUEST {
            return Some(Request::Bad);
        }
        if input.len() < body_start + length {
            return None;
        }
        let request = match (method, path) {
            ("GET", path) if path.starts_with("/sub/") => {
                Request::Subscribe(path["/sub/".len()..].to_string())
            }
            ("POST", path) if path.starts_with("/pub/") => Request::Publish(
                path["/pub/".len()..].to_string(),
                input[body_start..body_start + length].to_vec(),
            ),
            _ => Request::Bad,
        };
        connection.input.drain(..body_start + length);
        Some(request)
    }

    /// One `send` per subscriber of `channel` (every subscriber for a broadcast).
    fn deliver(&mut self, channel: Option<&str>, frame: &[u8]) {
        let mut gone = Vec::new();
        for slot in 0..self.subscribers.len() {
            let id = self.subscribers[slot];
            let connection = &self.connections[&id];
            let subscription = connection.subscription.as_ref().expect("a subscriber");
            if channel.is_some_and(|channel| subscription.channel != channel) {
                continue;
            }
            if !self.write(id, frame) {
                gone.push(id);
            }
        }
        for id in gone {
            self.close(id);
        }
    }

    /// Sends `bytes` to `id`, or closes it when it cannot take them.
    fn send(&mut self, id: u64, bytes: &[u8]) -> bool {
        let sent = self.write(id, bytes);
        if !sent {
            self.close(id);
        }
        sent
    }

    /// Writes what the socket takes and watches for room when some is left; false when the
    /// connection is to be closed.
    fn write(&mut self, id: u64, bytes: &[u8]) -> bool {
        let Some(connection) = self.connections.get_mut(&id) else {
            return false;
        };
        let was_behind = !connection.behind.is_empty();
        if !push(connection, bytes) {
            return false;
        }
        if !was_behind && !connection.behind.is_empty() {
            let fd = connection.stream.as_raw_fd();
            let _ = self.control(libc::EPOLL_CTL_MOD, fd, id, libc::EPOLLIN | libc::EPOLLOUT);
        }
        true
    }

    fn catch_up(&mut self, id: u64) {
        let Some(connection) = self.connections.get_mut(&id) else {
            return;
        };
        let behind = std::mem::take(&mut connection.behind);
        if !push(connection, &behind) {
            self.close(id);
            return;
        }
        if connection.behind.is_empty() {
            let fd = connection.stream.as_raw_fd();
            let _ = self.control(libc::EPOLL_CTL_MOD, fd, id, libc::EPOLLIN);
        }
    }

    fn close(&mut self, id: u64) {
        // Dropping the stream closes it, which also removes it from the epoll set.
        let Some(connection) = self.connections.remove(&id) else {
            return;
        };
        if let Some(Subscription { slot, .. }) = connection.subscription {
            self.subscribers.swap_remove(slot);
            if let Some(&moved) = self.subscribers.get(slot) {
                let moved = self
                    .connections
                    .get_mut(&moved)
                    .expect("subscribers are present");
                moved.subscription.as_mut().expect("a subscriber").slot = slot;
            }
        }
        if !self.accepting {
            let fd = self.listener.as_raw_fd();
            self.accepting = self.watch(fd, LISTENER, libc::EPOLLIN).is_ok();
        }
    }
}

enum Request {
    Subscribe(String),
    Publish(String, Vec<u8>),
    Bad,
}

/// Writes what the socket takes and keeps the rest; false when the connection is to be closed.
fn push(connection: &mut Connection, bytes: &[u8]) -> bool {
    if !connection.behind.is_empty() {
        connection.behind.extend_from_slice(bytes);
        return connection.behind.len() <= MAX_BEHIND;
    }
    let mut written = 0;
    while written < bytes.len() {
        match connection.stream.write(&bytes[written..]) {
            Ok(n) => written += n,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                connection.behind.extend_from_slice(&bytes[written..]);
                return true;
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

fn event_fd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn wake(waker: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to our own eventfd.
    unsafe { libc::write(waker.as_raw_fd(), one.as_ptr().cast(), 8) };
}

/// A listener of its own per thread, as nginx's `reuseport`, so each thread accepts on itself.
fn reuse_port_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}
