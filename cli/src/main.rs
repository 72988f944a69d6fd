fn main() { println!("{:?}", weft::registry::providers().0.iter().map(|f| f.name()).collect::<Vec<_>>()); }
