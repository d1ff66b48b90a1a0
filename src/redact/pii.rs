//! Personal data in text: e-mail addresses, payment card numbers (Luhn), IBANs
//! (mod 97), US social security numbers and E.164 phone numbers. Each is found by
//! one pass over the bytes that stops only at `@`, `+` and the start of a digit run,
//! and a candidate counts only once its validator agrees. The outgoing-secrets
//! scanner uses these; the capture's redaction does not (it keeps secrets out of
//! the store, not personal data out of the prompt).

/// One personal-data value: its byte range and its detector's name.
pub(crate) type Hit = (usize, usize, &'static str);

/// The personal data in `input`, in order, not overlapping.
pub(crate) fn find(input: &[u8], out: &mut Vec<Hit>) {
    let mut i = 0;
    let n = input.len();
    while i < n {
        let b = input[i];
        let next = match b {
            b'@' => email(input, i, out),
            b'+' => phone(input, i, out),
            b'0'..=b'9' if i == 0 || !input[i - 1].is_ascii_alphanumeric() => digits(input, i, out),
            _ => None,
        };
        i = next.unwrap_or(i + 1);
    }
}

fn is_local(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'%' | b'+' | b'-')
}

fn is_domain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-')
}

/// An e-mail address around the `@` at `at`; returns where to go on.
fn email(input: &[u8], at: usize, out: &mut Vec<Hit>) -> Option<usize> {
    let start = (at.saturating_sub(64)..at)
        .rev()
        .take_while(|&j| is_local(input[j]))
        .last()?;
    // `\n` before the address in JSON: the `n` is not part of it.
    let start = if start >= 1 && input[start - 1] == b'\\' {
        start + 1
    } else {
        start
    };
    let start = (start..at).find(|&j| input[j].is_ascii_alphanumeric())?;
    let mut end = at + 1;
    while end < input.len() && end - at <= 255 && is_domain(input[end]) {
        end += 1;
    }
    // The domain ends on its last label: letters, at least two.
    while end > at + 1 && matches!(input[end - 1], b'.' | b'-') {
        end -= 1;
    }
    let domain = &input[at + 1..end];
    let dot = domain.iter().rposition(|&b| b == b'.')?;
    let tld = &domain[dot + 1..];
    if dot == 0 || tld.len() < 2 || !tld.iter().all(u8::is_ascii_alphabetic) {
        return None;
    }
    out.push((start, end, "email"));
    Some(end)
}

/// An E.164 number (`+` and 8 to 15 digits, spaces or dashes between groups).
fn phone(input: &[u8], at: usize, out: &mut Vec<Hit>) -> Option<usize> {
    if at > 0 && (input[at - 1].is_ascii_alphanumeric() || input[at - 1] == b'+') {
        return None;
    }
    let (end, count) = digit_run(input, at + 1, b" -");
    if !(8..=15).contains(&count) || input.get(at + 1).is_none_or(|b| !(b'1'..=b'9').contains(b)) {
        return None;
    }
    out.push((at, end, "phone"));
    Some(end)
}

/// Where a run of digits (with single `separators` between them) from `from` ends,
/// and how many digits it has.
fn digit_run(input: &[u8], from: usize, separators: &[u8]) -> (usize, usize) {
    let mut end = from;
    let mut count = 0;
    while end < input.len() {
        let b = input[end];
        if b.is_ascii_digit() {
            count += 1;
            end += 1;
        } else if separators.contains(&b)
            && input.get(end + 1).is_some_and(u8::is_ascii_digit)
            && end > from
        {
            end += 1;
        } else {
            break;
        }
    }
    (end, count)
}

/// A digit run that starts at `at`: a card number, a US SSN, or an IBAN's check
/// digits after its country code. Returns the run's end: nothing in it is looked at again.
fn digits(input: &[u8], at: usize, out: &mut Vec<Hit>) -> Option<usize> {
    let (end, count) = digit_run(input, at, b" -");
    let after_ok = end == input.len() || !input[end].is_ascii_alphanumeric();
    if after_ok && (13..=19).contains(&count) && luhn(&input[at..end]) {
        out.push((at, end, "card"));
        return Some(end);
    }
    if after_ok && count == 9 && ssn(&input[at..end]) {
        out.push((at, end, "us-ssn"));
        return Some(end);
    }
    Some(end.max(at + 1))
}

/// The IBANs in `input` (two capitals, two check digits, 11 to 30 letters or digits,
/// maybe in groups of four): found apart, since their start is a letter.
pub(crate) fn ibans(input: &[u8], out: &mut Vec<Hit>) {
    let mut from = 0;
    while let Some(i) = input[from..]
        .windows(4)
        .position(|w| {
            w[0].is_ascii_uppercase()
                && w[1].is_ascii_uppercase()
                && w[2].is_ascii_digit()
                && w[3].is_ascii_digit()
        })
        .map(|p| from + p)
    {
        from = i + 1;
        if i > 0 && input[i - 1].is_ascii_alphanumeric() {
            continue;
        }
        let mut end = i + 4;
        let mut chars = 4;
        while end < input.len() && chars < 34 {
            let b = input[end];
            if b.is_ascii_uppercase() || b.is_ascii_digit() {
                chars += 1;
                end += 1;
            } else if b == b' '
                && input
                    .get(end + 1)
                    .is_some_and(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
            {
                end += 1;
            } else {
                break;
            }
        }
        if end < input.len() && input[end].is_ascii_alphanumeric() {
            continue;
        }
        if (15..=34).contains(&chars) && iban_valid(&input[i..end]) {
            out.push((i, end, "iban"));
            from = end;
        }
    }
}

/// The Luhn checksum of the digits in `run` holds.
fn luhn(run: &[u8]) -> bool {
    let digits: Vec<u32> = run
        .iter()
        .filter(|b| b.is_ascii_digit())
        .map(|b| u32::from(b - b'0'))
        .collect();
    if digits.iter().all(|&d| d == digits[0]) {
        return false; // 0000 0000 0000 0000 passes Luhn and is no card
    }
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &d)| match (i % 2 == 1, d * 2) {
            (true, x) if x > 9 => x - 9,
            (true, x) => x,
            (false, _) => d,
        })
        .sum();
    sum.is_multiple_of(10)
}

/// `AAA-GG-SSSS` (or nine digits) that the SSA could have issued: no 000, 666 or
/// 9xx area, no 00 group, no 0000 serial.
fn ssn(run: &[u8]) -> bool {
    let digits: Vec<u8> = run.iter().filter(|b| b.is_ascii_digit()).copied().collect();
    let dashed = run.len() == 11 && run[3] == b'-' && run[6] == b'-';
    if !(dashed || run.len() == 9) || digits.len() != 9 {
        return false;
    }
    let area = &digits[..3];
    area != b"000"
        && area != b"666"
        && area[0] != b'9'
        && &digits[3..5] != b"00"
        && &digits[5..] != b"0000"
        // Nine bare digits are mostly other numbers: only the dashed form counts.
        && dashed
}

/// The ISO 13616 check: the rearranged number mod 97 is 1.
fn iban_valid(text: &[u8]) -> bool {
    let chars: Vec<u8> = text.iter().filter(|b| **b != b' ').copied().collect();
    let mut rem: u32 = 0;
    for &b in chars[4..].iter().chain(&chars[..4]) {
        let v = match b {
            b'0'..=b'9' => u32::from(b - b'0'),
            b'A'..=b'Z' => u32::from(b - b'A') + 10,
            _ => return false,
        };
        rem = if v >= 10 {
            (rem * 100 + v) % 97
        } else {
            (rem * 10 + v) % 97
        };
    }
    rem == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(text: &str) -> Vec<(&str, &'static str)> {
        let mut out = Vec::new();
        find(text.as_bytes(), &mut out);
        ibans(text.as_bytes(), &mut out);
        out.sort();
        out.iter().map(|(a, b, k)| (&text[*a..*b], *k)).collect()
    }

    #[test]
    fn each_kind_is_found_with_its_validator() {
        assert_eq!(
            found("mail jane.doe+x@example.co.uk, card 4111 1111 1111 1111."),
            [
                ("jane.doe+x@example.co.uk", "email"),
                ("4111 1111 1111 1111", "card")
            ]
        );
        assert_eq!(found("ssn 123-45-6789 ok"), [("123-45-6789", "us-ssn")]);
        assert_eq!(
            found("call +44 20 7946 0958 now"),
            [("+44 20 7946 0958", "phone")]
        );
        assert_eq!(
            found("IBAN GB82 WEST 1234 5698 7654 32 end"),
            [("GB82 WEST 1234 5698 7654 32", "iban")]
        );
        assert_eq!(
            found("DE89370400440532013000"),
            [("DE89370400440532013000", "iban")]
        );
    }

    #[test]
    fn near_misses_are_not_found() {
        for text in [
            "card 4111 1111 1111 1112",     // Luhn fails
            "0000 0000 0000 0000",          // all one digit
            "ssn 666-45-6789, 123-00-6789", // impossible area, group
            "id 123456789",                 // bare nine digits
            "GB82 WEST 1234 5698 7654 33",  // mod 97 fails
            "a@b, user@host, x@1.2",        // no real domain
            "version 1.2.3+4567890123",     // `+` after a digit
            "\\nnoreply",                   // no @ at all
        ] {
            let f = found(text);
            assert!(f.is_empty(), "{text}: {f:?}");
        }
    }

    #[test]
    fn an_address_after_a_json_newline_escape_starts_after_it() {
        assert_eq!(
            found(r"line\nbob@example.org"),
            [("bob@example.org", "email")]
        );
    }
}
