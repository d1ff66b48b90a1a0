//! The tape of a body that continues another: a conversation's next turn repeats
//! its last turn's bytes but for a few places (the new messages, a moved
//! `cache_control`). The tokens of the bytes both bodies begin with, and of the
//! bytes both end with, are the other tape's; only the bytes between are scanned.
//! The result is exactly what a fresh scan finds: the same tokens, the same noted
//! keys, the same error at the same byte, and the repeated-key check proven for
//! the same bodies (objects taken whole were proven in the other body; the keys
//! of objects open across the scanned bytes are compared again).

use super::{Keys, ScanError, Start, Tok, children, scan};

/// The shortest run shared at either end worth taking over: below it a fresh scan
/// costs less than finding where to take over.
const SHARED_ENOUGH: usize = 64;
/// How often the scan tries to take the other tape's end over before giving up: a
/// try costs a walk down the other tape, and a body whose end moved (a key
/// reordered) would otherwise pay it at every value.
const TRIES: u8 = 16;

/// A body's tape, to continue from: the body, its tokens and noted keys, and
/// whether its objects' keys are known distinct.
#[derive(Debug, Clone, Copy)]
pub struct Before<'a> {
    pub body: &'a [u8],
    pub toks: &'a [Tok],
    pub noted: &'a [u32],
    /// Every object's keys are distinct (proven by the scan or by `duplicate_key`).
    pub unique: bool,
}

/// Which tokens of a continued tape are the other tape's, so that what was read
/// of those (a unit cut from them) can be taken over too.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reused {
    /// Tokens below this index whose subtree ends below it too are the other
    /// tape's, the same bytes at the same places.
    pub same_below: u32,
    /// Tokens from here on are the other tape's, moved.
    pub moved: Option<Moved>,
}

/// The tokens [`Tail`] took over: from the new tape's index `from`, each is the
/// other tape's token `tokens` places before, `bytes` further on in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    pub from: u32,
    pub tokens: i64,
    pub bytes: i64,
}

/// [`super::tape_checking`] of `body`, taking the tokens of what it shares with
/// `before` at its start and at its end from `before`'s tape. The same answer as
/// a fresh scan, in the time of comparing the shared bytes and scanning the rest;
/// also which tokens were taken over.
pub fn tape_continuing(
    body: &[u8],
    before: Before<'_>,
    note: impl Fn(&[u8]) -> bool,
    noted: &mut Vec<u32>,
) -> Result<(Vec<Tok>, bool, Reused), ScanError> {
    let mut keys = Keys::checking();
    let resumed = if before.unique && u32::try_from(body.len()).is_ok() {
        resume(body, before, &mut keys, noted)
    } else {
        None
    };
    let mut reused = Reused {
        same_below: resumed.as_ref().map_or(0, |s| s.toks.len() as u32),
        moved: None,
    };
    let from = resumed.unwrap_or_else(|| {
        keys = Keys::checking();
        noted.clear();
        Start::fresh(body)
    });
    let toks = scan(body, &note, noted, &mut keys, from, &mut reused.moved)?;
    Ok((toks, !keys.unsure, reused))
}

/// Where `body` stops being `before.body`: the first byte that differs.
fn shared_start(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    // Whole blocks compare at memcmp's speed; only the block that differs is walked.
    for step in [4096, 64] {
        while i + step <= n && a[i..i + step] == b[i..i + step] {
            i += step;
        }
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// How many bytes `a` and `b` end with alike, at most `most`.
fn shared_end(a: &[u8], b: &[u8], most: usize) -> usize {
    let n = a.len().min(b.len()).min(most);
    let (a, b) = (&a[a.len() - n..], &b[b.len() - n..]);
    let mut k = 0;
    for step in [4096, 64] {
        while k + step <= n && a[n - k - step..n - k] == b[n - k - step..n - k] {
            k += step;
        }
    }
    k + a[..n - k]
        .iter()
        .rev()
        .zip(b[..n - k].iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

fn is_container(body: &[u8], tok: Tok) -> Option<bool> {
    match body.get(tok.start as usize) {
        Some(b'{') => Some(true),
        Some(b'[') => Some(false),
        _ => None,
    }
}

/// Notes the key token `key` of the object whose keys start at `base`, as
/// `tape_key` does.
fn check_key(keys: &mut Keys, body: &[u8], toks: &[Tok], base: usize, key: usize) {
    let escaped = memchr::memchr(b'\\', toks[key].of(body)).is_some();
    keys.key(body, toks, base, key as u32, escaped);
}

/// The scan's state just past the last value `body` shares whole with `before`
/// at its start, with the tokens before it: `None` when too little is shared.
fn resume<'a>(
    body: &[u8],
    before: Before<'a>,
    keys: &mut Keys,
    noted: &mut Vec<u32>,
) -> Option<Start<'a>> {
    let old = before.toks;
    let shared = shared_start(body, before.body);
    if shared < SHARED_ENOUGH || old.is_empty() || old[0].start as usize >= shared {
        return None;
    }
    // The walk below jumps from child to child through a tape made a turn ago and
    // gone cold, each jump a wait on memory; read in order first, the tokens come at
    // streaming speed (200 KB conversations: this function 1.2–1.6 → 0.6–0.7 % of
    // the process's samples).
    let visited = old.partition_point(|t| (t.start as usize) < shared);
    std::hint::black_box(old[..visited].iter().fold(0, |a, t| a ^ t.next));
    // Down the containers open at the first byte that differs; in each, past its
    // children whole before it (a value's last byte and the one after it shared,
    // so a number ends where it ended).
    let mut path: Vec<usize> = Vec::new();
    let mut c = 0;
    let (keep, i, after_value) = loop {
        let object = is_container(before.body, old[c])?;
        path.push(c);
        let mut done = None;
        let mut into = None;
        for (key, value) in children(old, c, object) {
            if key.is_some_and(|k| old[k].end as usize >= shared) {
                break;
            }
            let v = old[value];
            if (v.end as usize) < shared {
                done = Some(value);
                continue;
            }
            if (v.start as usize) < shared && is_container(before.body, v).is_some() {
                into = Some(value);
            }
            break;
        }
        if let Some(v) = into {
            c = v;
            continue;
        }
        match done {
            Some(w) => break (old[w].next as usize, old[w].end as usize, true),
            // Nothing whole inside: this container is scanned again from its start.
            None => {
                path.pop();
                if path.is_empty() {
                    return None;
                }
                break (c, old[c].start as usize, false);
            }
        }
    };
    let mut toks = Vec::with_capacity(body.len() / 64 + 8);
    toks.extend_from_slice(&old[..keep]);
    let mut open = Vec::with_capacity(path.len());
    for &c in &path {
        // Closed again by the scan, wherever this body closes it.
        toks[c].end = 0;
        toks[c].next = 0;
        let object = is_container(before.body, old[c])?;
        let base = keys.open.len();
        if object {
            for (key, _) in children(old, c, true) {
                match key {
                    Some(k) if k < keep => check_key(keys, body, &toks, base, k),
                    _ => break,
                }
            }
        }
        open.push((c, object, base));
    }
    noted.clear();
    noted
        .extend_from_slice(&before.noted[..before.noted.partition_point(|&n| (n as usize) < keep)]);
    let tail = Tail::new(body, before, shared);
    #[cfg(test)]
    tests::RESUMED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(Start {
        toks,
        open,
        i,
        after_value,
        tail,
    })
}

/// What `body` shares with `before` at its end, to take over once the scan of the
/// bytes between stands where `before`'s scan stood.
pub(super) struct Tail<'a> {
    before: Before<'a>,
    /// Where the shared end starts in the new body (`usize::MAX`: given up).
    from: usize,
    /// New position less old position, over the shared end.
    shift: i64,
    tries: u8,
}

impl<'a> Tail<'a> {
    fn new(body: &[u8], before: Before<'a>, shared_start: usize) -> Option<Tail<'a>> {
        // Not overlapping the shared start: each byte is taken over once.
        let most = body.len().min(before.body.len()) - shared_start;
        let shared = shared_end(body, before.body, most);
        (shared >= SHARED_ENOUGH).then(|| Tail {
            before,
            from: body.len() - shared,
            shift: body.len() as i64 - before.body.len() as i64,
            tries: 0,
        })
    }

    /// Where the scan may try [`Tail::take_over`].
    pub(super) fn from(&self) -> usize {
        self.from
    }

    /// At `i` (in the shared end) just past a value, with the containers `open`:
    /// when `before`'s scan stood just past a value there too, with containers of
    /// the same kinds open, appends `before`'s remaining tokens (moved by the shift)
    /// and closes the open containers where `before` closed them; the keys taken
    /// over into open objects are compared with theirs. Which tokens it took, or
    /// `None`: not the same place; the scan goes on.
    pub(super) fn take_over(
        &mut self,
        body: &[u8],
        toks: &mut Vec<Tok>,
        open: &[(usize, bool, usize)],
        i: usize,
        keys: &mut Keys,
        noted: &mut Vec<u32>,
    ) -> Option<Moved> {
        self.tries += 1;
        if self.tries >= TRIES {
            self.from = usize::MAX;
        }
        let path = self.place(open, i)?;
        let old = self.before.toks;
        let w = path[path.len() - 1];
        let rest = old[w].next as usize;
        let (shift, dt) = (self.shift, toks.len() as i64 - rest as i64);
        let moved = |v: u32, by: i64| (i64::from(v) + by) as u32;
        let taken = Moved {
            from: toks.len() as u32,
            tokens: dt,
            bytes: shift,
        };
        toks.extend(old[rest..].iter().map(|t| Tok {
            start: moved(t.start, shift),
            end: moved(t.end, shift),
            next: moved(t.next, dt),
        }));
        // Innermost first: an object's keys are compared while its own are the last
        // in `keys.open`, as when the scan closes it.
        for (depth, &(c, object, base)) in open.iter().enumerate().rev() {
            let (old_c, inside) = (path[depth], path[depth + 1]);
            if object {
                let mut k = old[inside].next as usize;
                while k < old[old_c].next as usize {
                    check_key(keys, body, toks, base, moved(k as u32, dt) as usize);
                    k = old[k + 1].next as usize;
                }
            }
            keys.open.truncate(base);
            toks[c].end = moved(old[old_c].end, shift);
            toks[c].next = moved(old[old_c].next, dt);
        }
        let noted_from = self.before.noted.partition_point(|&n| (n as usize) < rest);
        noted.extend(
            self.before.noted[noted_from..]
                .iter()
                .map(|&n| moved(n, dt)),
        );
        self.from = usize::MAX;
        #[cfg(test)]
        tests::TAKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(taken)
    }

    /// `before`'s containers open at the new body's `i`, outermost first, then the
    /// value that ends there: when that is the same place in the grammar (the same
    /// depth, containers of the same kinds).
    fn place(&self, open: &[(usize, bool, usize)], i: usize) -> Option<Vec<usize>> {
        let (body, old) = (self.before.body, self.before.toks);
        let t = usize::try_from(i as i64 - self.shift).ok()?;
        let mut path = Vec::with_capacity(open.len() + 1);
        let mut c = 0;
        loop {
            let object = is_container(body, *old.get(c)?)?;
            if open.get(path.len()).map(|o| o.1) != Some(object) {
                return None;
            }
            path.push(c);
            let (_, value) = children(old, c, object).find(|&(_, v)| old[v].end as usize >= t)?;
            let v = old[value];
            if v.end as usize == t {
                if path.len() != open.len() {
                    return None;
                }
                path.push(value);
                return Some(path);
            }
            if (v.start as usize) >= t || path.len() >= open.len() {
                return None;
            }
            c = value;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::super::{duplicate_key, tape_checking};
    use super::*;

    /// Scans that began part way in, and that took the other tape's end over.
    pub(super) static RESUMED: AtomicUsize = AtomicUsize::new(0);
    pub(super) static TAKEN: AtomicUsize = AtomicUsize::new(0);

    /// A small deterministic generator (xorshift): the same cases every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    const KEYS: [&str; 9] = [
        "model",
        "messages",
        "role",
        "content",
        "text",
        "cache_control",
        "type",
        "a",
        "mod\\u0065l",
    ];

    fn value(r: &mut Rng, depth: usize, out: &mut String) {
        let ws = |r: &mut Rng, out: &mut String| {
            if r.below(4) == 0 {
                out.push_str([" ", "\n", "\t ", "\r\n  "][r.below(4)]);
            }
        };
        ws(r, out);
        match if depth >= 4 {
            2 + r.below(3)
        } else {
            r.below(5)
        } {
            0 => {
                out.push('{');
                let n = r.below(5);
                let mut used = Vec::new();
                for k in 0..n {
                    if k > 0 {
                        out.push(',');
                    }
                    // Now and then a key twice: the check must see it (a body with
                    // one is not continued from, so only now and then).
                    let key = KEYS[r.below(KEYS.len())];
                    if used.contains(&key) && r.below(16) != 0 {
                        out.push_str(&format!("\"{key}{k}\""));
                    } else {
                        out.push_str(&format!("\"{key}\""));
                    }
                    used.push(key);
                    ws(r, out);
                    out.push(':');
                    value(r, depth + 1, out);
                }
                ws(r, out);
                out.push('}');
            }
            1 => {
                out.push('[');
                for k in 0..r.below(6) {
                    if k > 0 {
                        out.push(',');
                    }
                    value(r, depth + 1, out);
                }
                ws(r, out);
                out.push(']');
            }
            2 => {
                let parts = ["abc", "\\\"", "\\\\", "x y", "\\n", "é", "{[", "\\u0041"];
                out.push('"');
                for _ in 0..r.below(6) {
                    out.push_str(parts[r.below(parts.len())]);
                }
                out.push('"');
            }
            3 => out.push_str(["0", "12", "-3.5e2", "123456"][r.below(4)]),
            _ => out.push_str(["true", "false", "null"][r.below(3)]),
        }
        ws(r, out);
    }

    /// A changed copy of `doc`: bytes put in, taken out or replaced somewhere,
    /// often a whole value put in an array (a turn's new messages), sometimes
    /// breaking the JSON.
    fn changed(r: &mut Rng, doc: &str) -> String {
        let b = doc.as_bytes();
        let at = r.below(b.len() + 1);
        let upto = (at + r.below(24)).min(b.len());
        let mut out = b[..at].to_vec();
        match r.below(6) {
            0 => {}
            1 => out.extend_from_slice(&b[at..upto]),
            2 => {
                let mut v = String::new();
                value(r, 3, &mut v);
                out.extend_from_slice(v.as_bytes());
                out.push(b',');
            }
            3 => out.push([b'"', b',', b'1', b'}', b'\\', b' '][r.below(6)]),
            // A key of the object the place is in, maybe one it has already.
            4 => {
                out.extend_from_slice(format!("\"{}\":", KEYS[r.below(KEYS.len())]).as_bytes());
                value(r, 3, &mut String::new());
                out.extend_from_slice(b"1,");
            }
            _ => {
                let mut v = String::new();
                value(r, 2, &mut v);
                out.extend_from_slice(v.as_bytes());
            }
        }
        out.extend_from_slice(&b[upto..]);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// `doc` as a conversation's next turn: a message more at the end of its
    /// messages, and now and then one of its strings changed (a moved marker).
    fn grown(r: &mut Rng, doc: &str) -> String {
        let b = doc.as_bytes();
        let toks = super::super::tape(b).expect("the generated documents are JSON");
        let close = toks[4].end as usize - 1;
        let mut message = String::from(",");
        value(r, 1, &mut message);
        let mut out = [&b[..close], message.as_bytes(), &b[close..]].concat();
        if r.below(2) == 0 {
            let strings: Vec<&Tok> = toks[5..toks[4].next as usize]
                .iter()
                .filter(|t| b[t.start as usize] == b'"' && b.get(t.end as usize) != Some(&b':'))
                .collect();
            if let Some(t) = strings.get(r.below(strings.len().max(1))) {
                out.splice(t.start as usize + 1..t.end as usize - 1, *b"changed");
            }
        }
        String::from_utf8(out).expect("UTF-8")
    }

    fn note(key: &[u8]) -> bool {
        key.len() > 5 && key[1] == b'c'
    }

    /// A tape, whether its keys were proven distinct, and the noted keys.
    type Scanned = (Result<(Vec<Tok>, bool), ScanError>, Vec<u32>);

    fn fresh(body: &[u8]) -> Scanned {
        let mut noted = Vec::new();
        (tape_checking(body, note, &mut noted), noted)
    }

    /// Both scans say the same: the tokens, the noted keys, the error's byte, and
    /// the keys distinct or not once `duplicate_key` had its say.
    fn assert_same(body: &[u8], before: &[u8]) -> bool {
        let (want, want_noted) = fresh(body);
        let (old, old_noted) = fresh(before);
        let Ok((old_toks, old_proven)) = old else {
            return false;
        };
        let unique = old_proven || duplicate_key(before, &old_toks).is_none();
        let before = Before {
            body: before,
            toks: &old_toks,
            noted: &old_noted,
            unique,
        };
        let mut noted = vec![7, 7, 7];
        let got = tape_continuing(body, before, note, &mut noted).map(|(t, p, _)| (t, p));
        let text = String::from_utf8_lossy(body);
        match (&want, &got) {
            (Ok((w, w_proven)), Ok((g, g_proven))) => {
                assert_eq!(w, g, "tokens of {text}");
                assert_eq!(want_noted, noted, "noted keys of {text}");
                let settled = |proven: bool| proven || duplicate_key(body, w).is_none();
                assert_eq!(settled(*w_proven), settled(*g_proven), "keys of {text}");
                assert!(
                    !*g_proven || duplicate_key(body, w).is_none(),
                    "proved: {text}"
                );
            }
            (Err(w), Err(g)) => assert_eq!(w, g, "the error in {text}"),
            _ => panic!("{want:?} against {got:?} for {text}"),
        }
        true
    }

    #[test]
    fn a_continued_tape_is_the_tape_a_fresh_scan_makes() {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        let mut compared = 0;
        for _ in 0..6000 {
            // A conversation's shape: what changes is mostly in the messages, and
            // the tools and settings after them are long enough to be taken over.
            let mut doc = String::from("{\"model\":\"claude-x\",\"messages\":[");
            for k in 0..1 + r.below(16) {
                if k > 0 {
                    doc.push(',');
                }
                value(&mut r, 1, &mut doc);
            }
            doc.push_str("],\"tools\":[");
            for k in 0..1 + r.below(6) {
                if k > 0 {
                    doc.push(',');
                }
                value(&mut r, 2, &mut doc);
            }
            doc.push_str("],\"system\":");
            value(&mut r, 3, &mut doc);
            doc.push_str(
                ",\"metadata\":{\"user_id\":\"0123456789abcdef0123456789\"},\"stream\":true}",
            );
            let next = if r.below(2) == 0 {
                grown(&mut r, &doc)
            } else {
                (0..1 + r.below(3)).fold(doc.clone(), |d, _| changed(&mut r, &d))
            };
            if assert_same(next.as_bytes(), doc.as_bytes()) {
                compared += 1;
            }
        }
        assert!(
            compared > 3000,
            "only {compared} cases had a tape to continue"
        );
        let (resumed, taken) = (
            RESUMED.load(Ordering::Relaxed),
            TAKEN.load(Ordering::Relaxed),
        );
        assert!(
            resumed > 2000 && taken > 1000,
            "resumed {resumed}, taken over {taken}"
        );
    }

    #[test]
    fn a_turn_takes_its_start_and_its_end_from_the_turn_before() {
        let msg = |n: usize| {
            format!(
                "{{\"role\":\"user\",\"content\":\"{}\"}}",
                "w ".repeat(40 + n)
            )
        };
        let tools = format!(
            "[{}]",
            vec!["{\"name\":\"Bash\",\"input_schema\":{\"type\":\"object\"}}"; 20].join(",")
        );
        let body = |turns: usize| {
            let msgs: Vec<String> = (0..turns).map(msg).collect();
            format!(
                "{{\"model\":\"m\",\"messages\":[{}],\"system\":\"s\",\"tools\":{tools},\"stream\":true}}",
                msgs.join(",")
            )
        };
        let (before, after) = (body(30), body(31));
        assert!(assert_same(after.as_bytes(), before.as_bytes()));
        // Taken over at both ends: only the new message and what closes around it
        // were scanned.
        let (Ok((old, _)), old_noted) = fresh(before.as_bytes()) else {
            panic!("JSON")
        };
        let b = Before {
            body: before.as_bytes(),
            toks: &old,
            noted: &old_noted,
            unique: true,
        };
        let mut keys = Keys {
            on: true,
            ..Keys::default()
        };
        let start =
            resume(after.as_bytes(), b, &mut keys, &mut Vec::new()).expect("a shared start");
        assert!(
            start.toks.len() > 30 * 4,
            "the first 30 messages taken: {}",
            start.toks.len()
        );
        let tail = start.tail.expect("a shared end");
        assert!(tail.from() < after.len() - tools.len(), "the tools taken");
        // A key the scanned bytes put in an object that the end taken over has too:
        // the keys taken over are compared with the object's own.
        let (plain, repeated) = (
            body(30).replace(",\"system\":\"s\"", ""),
            body(31).replace("],\"system\":\"s\"", "],\"tools\":0"),
        );
        assert!(assert_same(repeated.as_bytes(), plain.as_bytes()));
        let (Ok((toks, proven)), _) = fresh(repeated.as_bytes()) else {
            panic!("JSON")
        };
        assert!(!proven && duplicate_key(repeated.as_bytes(), &toks).is_some());
        // Begun again at a container whose first value differs: its key is among
        // its object's keys, and a second one is seen.
        let strings = |last: &str, more: &str| {
            format!(
                "{{\"model\":\"m\",\"messages\":[\"{}{last}\"]{more},\"tools\":{tools}}}",
                "A".repeat(100)
            )
        };
        let again = strings("B", ",\"messages\":0");
        assert!(assert_same(again.as_bytes(), strings("A", "").as_bytes()));
        let (Ok((toks, _)), _) = fresh(again.as_bytes()) else {
            panic!("JSON")
        };
        assert!(duplicate_key(again.as_bytes(), &toks).is_some());
        // The same bytes at the end, read inside containers of other kinds: not taken
        // over, and the error found where a fresh scan finds it.
        let (a, b) = ("A".repeat(80), "B".repeat(80));
        let array = format!(r#"{{"p":"{a}","q":["s",{{"z":"{b}"}}]}}"#);
        let object = format!(r#"{{"p":"{a}","q":{{"s":{{"z":"{b}"}}]}}"#);
        assert!(assert_same(object.as_bytes(), array.as_bytes()));
        assert!(fresh(object.as_bytes()).0.is_err());
        // A body that shares too little is scanned afresh, with the same answer.
        assert!(assert_same(b"{\"x\":1}", before.as_bytes()));
    }
}
